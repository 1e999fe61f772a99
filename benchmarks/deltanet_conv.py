"""The gated-DeltaNet layers' short causal convolution alone, forward and backward, at a model's shape: transformers'
reference path (a depthwise ``F.conv1d`` over [1, C, L], what its layers run without the ``causal-conv1d``
package) against fla's Triton kernel as asyncrl/packing/deltanet.py runs it on CUDA (issue 57, item 2). Prints each
one's median milliseconds per layer and per row (times the model's gated-DeltaNet layers), and the largest difference
between the two in float32 and bfloat16. Random inputs, nothing downloaded; needs CUDA and fla (``fla-core``).

    python benchmarks/deltanet_conv.py                    # Qwen3.5-2B: 18 layers of 6,144 channels, 4 taps
    python benchmarks/deltanet_conv.py --tokens 16384 32768 --layers 18 --channels 6144
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[1, L, C] -> [1, L, C] through transformers' reference: the depthwise convolution over [1, C, L], cut to L.
    Written out, since where transformers keeps it moves between releases (tests check it equals theirs)."""
    length, taps = x.shape[1], weight.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=taps - 1, groups=weight.shape[0])
    return out[..., :length].transpose(1, 2)


def fla_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[1, L, C] -> [1, L, C] through fla's Triton kernel, as deltanet.packed_conv calls it."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight, None)[0]


def median_ms(run: Callable[[], None], repeats: int) -> float:
    """Median of ``repeats`` timed calls after three untimed ones (Triton compiles and autotunes in the first)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def forward_backward(conv: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor) -> Callable[[], None]:
    """One layer's convolution forward and backward, as a training step runs it."""
    grad = torch.randn_like(x)

    def run() -> None:
        out = conv(x, weight)
        torch.autograd.grad(out, (x, weight), grad)

    return run


def largest_difference(tokens: int, channels: int, taps: int, dtype: torch.dtype) -> float:
    """The largest absolute difference between the two, output and both gradients, on one random input."""
    x = torch.randn(1, tokens, channels, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(channels, taps, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    results = []
    for conv in (reference, fla_kernel):
        out = conv(x, weight)
        results.append((out, *torch.autograd.grad(out, (x, weight), grad)))
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*results, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384], help="a packed row's length")
    parser.add_argument("--channels", type=int, default=6144, help="q, k and v widths together (2B: 2*2048 + 2048)")
    parser.add_argument("--taps", type=int, default=4, help="linear_conv_kernel_dim")
    parser.add_argument("--layers", type=int, default=18, help="the model's gated-DeltaNet layers (2B: 18 of 24)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results = []
    for tokens in args.tokens:
        x = torch.randn(1, tokens, args.channels, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(args.channels, args.taps, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        row = {"tokens": tokens, "channels": args.channels, "taps": args.taps, "layers": args.layers}
        for name, conv in (("reference", reference), ("fla", fla_kernel)):
            row[f"{name}_ms"] = median_ms(forward_backward(conv, x, weight), args.repeats)
        for dtype in (torch.float32, torch.bfloat16):
            row[f"max_diff_{str(dtype).removeprefix('torch.')}"] = largest_difference(
                tokens, args.channels, args.taps, dtype
            )
        results.append(row)
        print(
            f"{tokens} tokens x {args.channels} channels, bf16 forward+backward a layer: reference "
            f"{row['reference_ms']:.2f} ms, fla {row['fla_ms']:.2f} ms ({row['reference_ms'] / row['fla_ms']:.1f}x); "
            f"a row's {args.layers} layers: {row['reference_ms'] * args.layers:.0f} ms against "
            f"{row['fla_ms'] * args.layers:.0f} ms; largest difference float32 {row['max_diff_float32']:.2e}, "
            f"bfloat16 {row['max_diff_bfloat16']:.2e}",
            flush=True,
        )
    out = os.environ.get("OUT")
    if out:
        device = torch.cuda.get_device_name()
        Path(out, "deltanet_conv.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                               "runs": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
