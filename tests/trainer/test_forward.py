"""Chunked LM-head log-probabilities equal the full-logits computation (float64), values and gradients, directly
and through `packed_forward` (plain, peft LoRA, tied embeddings); compiled decoder layers match eager ones."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
from packing.packing_samples import build_tiny_qwen3, random_samples  # tests/packing

from asyncrl.packing import TreeRow
from asyncrl.packing.attention import RowPlans, attach_tree_attention, attention_windows
from asyncrl.trainer.forward import compile_decoder_layers, packed_forward, resolve_compile
from asyncrl.trainer.token_logprobs import compute_token_logprobs

TEMPERATURE = 0.7
CHUNKS = [1, 4, 7, 0, 1000]  # 0 = one chunk; 7 does not divide the slot counts used here


def reference(logits: torch.Tensor, targets, top_ids, sets, temperature: float):
    """The unchunked computation on full [T, V] logits: log softmax over each slot's set, entropy without grad."""
    z = logits / temperature
    if sets is not None:
        keep = torch.ones_like(z, dtype=torch.bool)
        for slot, candidates in enumerate(sets):
            if candidates is not None:
                keep[slot] = False
                keep[slot, candidates] = True
        z = z.masked_fill(~keep, float("-inf"))
    logprobs = z.log_softmax(-1)
    with torch.no_grad():
        probs = logprobs.exp()
        entropy = -(probs * torch.where(probs > 0, logprobs, 0)).sum(-1)
    top = logprobs.gather(1, top_ids) if top_ids is not None else None
    return logprobs.gather(1, targets[:, None]).squeeze(1), top, entropy


def random_problem(seed: int, slots: int = 23, dim: int = 6, vocab: int = 40, with_sets: bool = True):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(slots, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(dim, vocab, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=gen) * 2)
    targets = torch.randint(vocab, (slots,), generator=gen)
    top_ids = torch.randint(vocab, (slots, 3), generator=gen)
    top_ids[:, 2] = 0  # padding repeats an id, as the packers pad
    sets = None
    if with_sets:
        sets = [None if slot % 3 == 0 else sorted({int(targets[slot]), *rng.sample(range(vocab), rng.randint(0, 9))})
                for slot in range(slots)]  # fmt: skip
    return hidden, head, targets, top_ids, sets


def loss_of(logprobs: torch.Tensor, top: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(logprobs.shape, generator=gen, dtype=logprobs.dtype), torch.randn(top.shape, generator=gen)
    return (a * logprobs).sum() + torch.where(torch.isfinite(top), b.to(top.dtype) * top, 0).sum()


def grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_sets", [True, False])
def test_chunked_logprobs_top_k_entropy_and_gradients_equal_full_logits(chunk, with_sets):
    hidden, head, targets, top_ids, sets = random_problem(seed=chunk, with_sets=with_sets)
    out = compute_token_logprobs(hidden, head, targets, TEMPERATURE, top_ids=top_ids, sampling_masks=sets,
                                 chunk_tokens=chunk)  # fmt: skip
    expected = reference(head(hidden), targets, top_ids, sets, TEMPERATURE)
    torch.testing.assert_close(out.logprobs, expected[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(out.top_logprobs, expected[1], atol=1e-10, rtol=0)  # -inf outside a set, as before
    torch.testing.assert_close(out.entropy, expected[2], atol=1e-10, rtol=0)
    assert not out.entropy.requires_grad
    assert with_sets == bool(torch.isinf(out.top_logprobs).any())
    params = [hidden, head.weight, head.bias]
    for got, want in zip(grads(loss_of(out.logprobs, out.top_logprobs, 1), params),
                         grads(loss_of(expected[0], expected[1], 1), params), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_without_top_ids_and_without_weight_grad():
    """LoRA freezes the head: only the hidden states get a gradient (the weight-gradient matmul is skipped)."""
    hidden, head, targets, _, _ = random_problem(seed=3, with_sets=False)
    head.requires_grad_(False)
    out = compute_token_logprobs(hidden, head, targets, 1.0, chunk_tokens=5)
    assert out.top_logprobs is None
    expected = reference(head(hidden), targets, None, None, 1.0)[0]
    torch.testing.assert_close(grads(out.logprobs.sum(), [hidden])[0], grads(expected.sum(), [hidden])[0],
                               atol=1e-10, rtol=0)  # fmt: skip


def test_the_default_chunk_holds_a_gibibyte_of_logits_at_the_heads_vocabulary(monkeypatch):
    """trainer.logit_chunk_tokens null: a chunk is as many tokens as LOGIT_CHUNK_BYTES of float32 logits hold at the
    head's vocabulary (here shrunk to 5 tokens' worth of the 40-word head), and the result is the full logits'."""
    from asyncrl.trainer import token_logprobs

    hidden, head, targets, _, _ = random_problem(seed=5, with_sets=False)
    monkeypatch.setattr(token_logprobs, "LOGIT_CHUNK_BYTES", 5 * 40 * 4 + 3)
    sizes = []
    original = token_logprobs.Chunking.epilogue
    monkeypatch.setattr(token_logprobs.Chunking, "epilogue",
                        lambda self, fn, tokens: sizes.append(tokens) or original(self, fn, tokens))  # fmt: skip
    out = compute_token_logprobs(hidden, head, targets, 1.0)
    assert sizes == [5, 5, 5, 5, 3]  # 23 slots
    torch.testing.assert_close(out.logprobs, reference(head(hidden), targets, None, None, 1.0)[0], atol=1e-10, rtol=0)


def test_bad_chunk_size_and_temperature_name_the_setting():
    hidden, head, targets, _, _ = random_problem(seed=4, with_sets=False)
    with pytest.raises(ValueError, match="logit_chunk_tokens=-1"):
        compute_token_logprobs(hidden, head, targets, 1.0, chunk_tokens=-1)
    with pytest.raises(ValueError, match="temperature=0"):
        compute_token_logprobs(hidden, head, targets, 0, chunk_tokens=4)


# ---- through packed_forward -----------------------------------------------------------------------------------


def packed_row(seed: int, top_k: int = 2, with_sets: bool = True):
    samples = random_samples(seed, num_groups=2, max_group=4)
    row = TreeRow(10_000)
    for sample in samples:
        row.add(sample)
    packed = row.pack(top_k=top_k)
    if with_sets:
        rng = random.Random(seed)
        packed.sampling_masks = [None if rng.random() < 0.3 else sorted({int(t), *rng.sample(range(48), 6)})
                                 for t in packed.target_ids]  # fmt: skip
    return packed


def full_logits_reference(model, row, temperature):
    """packed_forward's result computed the unchunked way: the model's own [T, V] logits at the kept positions."""
    attach_tree_attention(model)
    plan = RowPlans.build("sdpa", row, torch.device("cpu"), attention_windows(model))
    out = model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                logits_to_keep=row.token_index, tree_plan=plan)  # fmt: skip
    return reference(out.logits[0], row.target_ids, row.top_ids, row.sampling_masks, temperature)


def assert_same_gradients(model, other, atol):
    theirs = dict(other.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, theirs[name].grad, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_forward_equals_full_logits_in_float64(tied):
    row = packed_row(seed=1)
    model = build_tiny_qwen3(1).to(torch.float64)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    other = copy.deepcopy(model)
    out = packed_forward(model, row, TEMPERATURE, attention="sdpa", logit_chunk_tokens=7)
    expected = full_logits_reference(other, row, TEMPERATURE)
    assert row.num_trained % 7 != 0 and torch.isinf(out.top_logprobs).any()
    for got, want in zip((out.logprobs, out.top_logprobs, out.entropy), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    loss_of(out.logprobs, out.top_logprobs, 2).backward()
    loss_of(expected[0], expected[1], 2).backward()
    assert_same_gradients(model, other, atol=1e-10)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_packed_forward_through_a_peft_lora_model_with_tied_embeddings():
    from peft import LoraConfig, get_peft_model

    row = packed_row(seed=2, with_sets=False)
    base = build_tiny_qwen3(2).to(torch.float64)
    base.config.tie_word_embeddings = True
    base.lm_head.weight = base.model.embed_tokens.weight
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():  # fresh adapters are zero: give B a value so the test can fail
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    other = copy.deepcopy(model)
    out = packed_forward(model, row, 1.0, attention="sdpa", logit_chunk_tokens=3)
    expected = full_logits_reference(other, row, 1.0)
    torch.testing.assert_close(out.logprobs, expected[0], atol=1e-10, rtol=0)
    loss_of(out.logprobs, out.top_logprobs, 3).backward()
    loss_of(expected[0], expected[1], 3).backward()
    assert_same_gradients(model, other, atol=1e-10)
    assert model.get_output_embeddings().weight.grad is None


def test_models_that_transform_the_head_output_are_refused():
    model = build_tiny_qwen3(3)
    model.config.logits_scaling = 8.0  # Granite's (Gemma's softcap is applied: tests/packing/test_gemma3.py)
    with pytest.raises(ValueError, match="logits_scaling"):
        packed_forward(model, packed_row(seed=3), 1.0, attention="sdpa")


# ---- compiled decoder layers ----------------------------------------------------------------------------------


def test_compile_setting_resolves_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cuda) == "inductor" and resolve_compile("auto", cpu) is None
    assert resolve_compile(True, cpu) == "inductor" and resolve_compile(False, cuda) is None
    assert resolve_compile("aot_eager", cpu) == "aot_eager"
    assert resolve_compile("True", cpu) == "inductor" and resolve_compile("false", cuda) is None  # from the config
    with pytest.raises(ValueError, match="trainer.compile_layers='yes'"):
        resolve_compile("yes", cpu)


def test_compiled_epilogues_equal_eager_ones():
    hidden, head, targets, top_ids, sets = random_problem(seed=5)
    kwargs = {"top_ids": top_ids, "sampling_masks": sets, "chunk_tokens": 7}
    out = compute_token_logprobs(hidden, head, targets, TEMPERATURE, compile_backend="aot_eager", **kwargs)
    eager = compute_token_logprobs(hidden, head, targets, TEMPERATURE, **kwargs)
    for got, want in zip((out.logprobs, out.top_logprobs, out.entropy), (eager.logprobs, eager.top_logprobs,
                                                                         eager.entropy), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    params = [hidden, head.weight, head.bias]
    for got, want in zip(grads(loss_of(out.logprobs, out.top_logprobs, 5), params),
                         grads(loss_of(eager.logprobs, eager.top_logprobs, 5), params), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_compiled_layers_match_eager_and_do_not_recompile_per_row_length():
    """aot_eager: Dynamo and AOTAutograd as on the GPU, without the C++ codegen that takes minutes on CPU
    (tracing alone takes ~30 s here)."""
    import torch._dynamo

    torch._dynamo.reset()
    rows = [packed_row(seed, with_sets=False) for seed in (4, 5)]
    assert rows[0].num_forwarded != rows[1].num_forwarded
    model = build_tiny_qwen3(4)
    eager = copy.deepcopy(model)
    compile_decoder_layers(model, backend="aot_eager")  # packed_forward's own call below is then a no-op
    for index, row in enumerate(rows):
        with torch._dynamo.config.patch(error_on_recompile=index == 1):  # a new length reuses the dynamic graphs
            out = packed_forward(model, row, 1.0, attention="sdpa", compile_layers="aot_eager")
        expected = packed_forward(eager, row, 1.0, attention="sdpa")
        torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)
        out.logprobs.sum().backward()
        expected.logprobs.sum().backward()
        assert_same_gradients(model, eager, atol=1e-5)
    torch._dynamo.reset()


def test_compiled_layers_stay_compiled_under_gradient_checkpointing():
    """transformers >= 5.24 checkpoints each layer's forward inside its compiled call, and the checkpoint turns
    torch.compile off: the layers ran eagerly (no graph) unless the checkpointed function is compiled itself."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def counting(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return aot_eager(graph, inputs)

    rows = [packed_row(seed, with_sets=False) for seed in (4, 5)]
    model = build_tiny_qwen3(4).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as trainer/model.py
    eager = copy.deepcopy(model)
    compile_decoder_layers(model, backend=counting)
    for index, row in enumerate(rows):
        with torch._dynamo.config.patch(error_on_recompile=index == 1):
            out = packed_forward(model, row, 1.0, attention="sdpa")  # the layers only: compiled above
        expected = packed_forward(eager, row, 1.0, attention="sdpa")
        torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=0)
        out.logprobs.sum().backward()
        expected.logprobs.sum().backward()
        assert_same_gradients(model, eager, atol=1e-5)
        if index == 0:
            compiled = len(graphs)
    assert compiled == len(graphs)  # the second row, of another length, compiled nothing
    mlp = any(node.target is torch.nn.functional.silu for graph in graphs for node in graph.graph.nodes)
    assert mlp, f"the decoder layers ran eagerly ({len(graphs)} graphs, none with the MLP's silu)"
    torch._dynamo.reset()


CHUNK = 4


@pytest.mark.parametrize(
    "row_slots",
    [
        # A row of k x logit_chunk_tokens + 1 trained tokens (or of one) ends in a one-token chunk, a size that
        # torch.compile specialises even with dynamic=True: it compiled both epilogues again mid-run. Such a chunk
        # runs eagerly.
        (2 * CHUNK + 3, 2 * CHUNK + 1, 1, CHUNK + 1, CHUNK),
        # A first row of one chunk hands the epilogues slices whose base (the row's targets) has the chunk's length:
        # duck sizing made them one size (guard ``targets._base.size()[0] == logits.size()[0]``, in the H200's
        # acceptance logs), and the first row of two chunks compiled both epilogues again mid-run.
        (CHUNK, 3 * CHUNK + 2, CHUNK - 1),
    ],
    ids=["one-token-chunk", "past-one-chunk"],
)
def test_compiled_epilogues_compile_once_for_every_row_size(row_slots):
    """Every row after the first reuses the first compile, with the eager values and gradients."""
    import torch._dynamo

    torch._dynamo.reset()
    for index, slots in enumerate(row_slots):
        hidden, head, targets, top_ids, sets = random_problem(seed=slots, slots=slots)
        kwargs = {"top_ids": top_ids, "sampling_masks": sets, "chunk_tokens": CHUNK}
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            out = compute_token_logprobs(hidden, head, targets, TEMPERATURE, compile_backend="aot_eager", **kwargs)
            got = grads(loss_of(out.logprobs, out.top_logprobs, slots), [hidden, head.weight, head.bias])
        eager = compute_token_logprobs(hidden, head, targets, TEMPERATURE, **kwargs)
        want = grads(loss_of(eager.logprobs, eager.top_logprobs, slots), [hidden, head.weight, head.bias])
        torch.testing.assert_close(out.logprobs, eager.logprobs, atol=1e-12, rtol=0)
        torch.testing.assert_close(out.top_logprobs, eager.top_logprobs, atol=1e-12, rtol=0)
        for got_grad, want_grad in zip(got, want, strict=True):
            torch.testing.assert_close(got_grad, want_grad, atol=1e-12, rtol=0)
    torch._dynamo.reset()


def test_compile_watch_logs_recompiles_and_compiles_after_the_first_row(caplog):
    from torch._dynamo.callback import callback_handler

    from asyncrl.trainer.forward import CompileWatch

    def scaled(x: torch.Tensor, factor: int) -> torch.Tensor:
        return x * factor

    caplog.set_level(logging.INFO, logger="asyncrl.trainer.forward")
    watch = CompileWatch()
    callback_handler.register_start_callback(watch.start)
    callback_handler.register_end_callback(watch.end)
    try:
        compiled = torch.compile(scaled, backend="eager")
        watch.row()  # the first row: its compiles are expected, earlier tests' recompiles are logged
        caplog.clear()
        compiled(torch.ones(2), 2)
        watch.row()
        assert not caplog.records
        compiled(torch.ones(2), 3)  # during the second row: a recompile
        watch.row()
        compiled(torch.ones(2, dtype=torch.float64), 3)  # during the last row, reported at the trainer's close
        watch.report()
    finally:
        callback_handler.remove_start_callback(watch.start)
        callback_handler.remove_end_callback(watch.end)
    compile_line, guard_line, *last_row = (record.message for record in caplog.records)
    assert compile_line.startswith("torch.compile: ") and "s compiling (dynamo, compile id" in compile_line
    assert "test_forward.py:" in compile_line  # the call that compiled, not torch's frames
    assert "compiled scaled (" in guard_line and "again during row 2: " in guard_line and "factor" in guard_line
    assert any("again during row 3: " in line and "dtype mismatch" in line for line in last_row)
