"""Images in packed rows (packing/images.py): every trained token's log-probability and the parameter gradients
(vision tower included) equal each sample's forwarded alone with its images by transformers' own forward, which
computes the M-RoPE positions itself; tiny Qwen3.5 vision-language model in float64 on CPU, tree and flat rows.
Log-probabilities agree to 1e-10 with attention-only text layers; Qwen3.5's gated-DeltaNet recurrence and its
RMSNorm compute in float32 whatever the model's dtype, which bounds the rest.

The samples hold what can go wrong: a GRPO group sharing one image prompt (its image passed once in a tree row),
a prompt alike but for its image (sharing none of its image tokens), two images of different grids in one prompt,
the same image followed by other text right after its last placeholder (a fork there would split the image), a
multi-turn sample forking inside a completion, text-only samples sharing the system prefix.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from packing_samples import (
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    build_tiny_vlm,
    make_images,
    make_sample,
    placeholders,
)
from test_exactness import TEMPERATURE, assert_gradients_match, pack

from asyncrl.packing import FlatRow, TreeRow
from asyncrl.packing import images as packing_images
from asyncrl.trainer.forward import packed_forward

SYSTEM = [3, 4, 5]


def image_samples(model: torch.nn.Module) -> list:
    x, y = make_images(model, [[1, 4, 4]], seed=1), make_images(model, [[1, 4, 4]], seed=2)
    two = make_images(model, [[1, 4, 4], [1, 2, 6]], seed=3)

    def wrapped(images, index):
        return [VISION_START, *placeholders(images, index), VISION_END]

    groups = [
        (SYSTEM + [6, *wrapped(x, 0), 7, 8], x, [[10, 11, 12], [10, 11, 13, 14], [15], [16, 17, 18, 19]]),
        (SYSTEM + [6, *wrapped(y, 0), 7, 8], y, [[10, 11], [20, 21, 22]]),
        (SYSTEM + [*wrapped(two, 0), 9, *wrapped(two, 1), 7], two, [[12, 13], [12, 14, 15]]),
        (SYSTEM + [6, VISION_START, *placeholders(x, 0), 30, 31], x, [[32, 33], [34]]),
        (SYSTEM + [6, 7], None, [[23, 24], [25]]),
    ]
    samples = []
    for g, (prompt, images, completions) in enumerate(groups):
        for c, completion in enumerate(completions):
            sample = make_sample(prompt + completion, len(prompt), g, 0.4 * c - 0.5 + 0.1 * g, seed=10 * g + c)
            sample.sequence.images = copy.deepcopy(images)  # each sample its own tensors, as off the rollout queue
            samples.append(sample)
    first = groups[0][0] + [10, 11]
    turn = make_sample(first + [26, 27], len(first), 0, 0.9, seed=99)  # a next turn forking inside a completion
    turn.sequence.images = copy.deepcopy(x)
    return [*samples, turn]


def alone_logprobs(model: torch.nn.Module, samples: list) -> torch.Tensor:
    """Each sample forwarded by itself with its images, the model computing its positions, in loss-slot order."""
    out = []
    for sample in samples:
        sequence = sample.sequence
        tokens = torch.tensor(sequence.token_ids)[None]
        inputs = {}
        if sequence.images is not None:
            images = sequence.images
            inputs = {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw,
                      "mm_token_type_ids": (tokens == IMAGE_TOKEN).int()}  # fmt: skip
        logits = model(input_ids=tokens, use_cache=False, **inputs).logits[0] / TEMPERATURE
        logprobs = logits.log_softmax(-1)[:-1].gather(1, tokens[0, 1:, None]).squeeze(1)
        out.append(logprobs[torch.tensor(sequence.mask[1:], dtype=torch.bool)])
    return torch.cat(out)


def assert_exact(row, model: torch.nn.Module, atol: float, rtol: float) -> None:
    reference = copy.deepcopy(model)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=atol, rtol=0)
    (row.advantages * packed).sum().backward()
    (row.advantages * expected).sum().backward()
    assert_gradients_match(model, reference, rtol=rtol)


def test_a_tree_row_passes_a_shared_image_once_and_never_splits_one():
    model = build_tiny_vlm(0)
    row = pack(image_samples(model))
    assert row.images is not None
    # group 0's image (5 samples), group 1's, the two of group 2, and group 3's copy of group 0's image, which
    # shares the tokens before it but not the one after its last placeholder
    assert row.images.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 4], [1, 4, 4], [1, 2, 6]]
    assert row.num_forwarded < row.num_raw_tokens
    flat = pack(image_samples(model), FlatRow)
    assert flat.images is not None and len(flat.images.image_grid_thw) == 13  # one per sample and image


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_packed_rows_match_each_sample_alone_with_its_images(row_cls):
    """Text layers all attention: float64 log-probabilities. The gradients of a weight sum over tokens, in float32
    where transformers' Qwen3.5 RMSNorm computes, in another order when packed."""
    model = build_tiny_vlm(1, deltanet=False)
    assert_exact(pack(image_samples(model), row_cls), model, atol=1e-10, rtol=1e-6)


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_gated_deltanet_layers_take_images_too(row_cls):
    """The hybrid: its gated-DeltaNet layers' float32 recurrence chunks a tree row's segments otherwise."""
    model = build_tiny_vlm(5)
    assert_exact(pack(image_samples(model), row_cls), model, atol=1e-6, rtol=1e-5)


def test_depth_positions_are_caught(monkeypatch):
    """Control: the row's depth as every M-RoPE axis and the comparison fails."""
    model = build_tiny_vlm(2, deltanet=False)
    row = pack(image_samples(model))
    expected = alone_logprobs(copy.deepcopy(model), row.samples)
    monkeypatch.setattr(packing_images, "mrope_positions", lambda model, row: row.position_ids.expand(3, -1))
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    assert (packed - expected).abs().max() > 1e-4


def test_placeholders_that_are_not_the_grids_are_refused():
    model = build_tiny_vlm(3)
    images = make_images(model, [[1, 4, 4]], seed=4)
    sample = make_sample([*SYSTEM, VISION_START, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, VISION_END, 7, 8], 8)
    sample.sequence.images = images
    for row_cls in (TreeRow, FlatRow):
        with pytest.raises(ValueError, match=r"3 image placeholder tokens \(id 47\) where its grids \[\[1, 4, 4\]\]"):
            pack([sample], row_cls)


def test_a_model_with_other_image_tokens_is_refused():
    model = build_tiny_vlm(4)
    row = pack(image_samples(model))
    model.config.image_token_id = 44
    with pytest.raises(ValueError, match="placeholder token 47 merged 2x2; .* image_token_id=44"):
        packed_forward(model, row, TEMPERATURE, attention="sdpa")


def embedded_alone(model: torch.nn.Module, sample) -> torch.Tensor:
    """The sample forwarded alone with its image's features written at its prompt's placeholders only (a
    completion's placeholder ids stay text), at the positions the model gives those tokens: the reference where
    transformers' own forward would take every placeholder id for an image's."""
    sequence = sample.sequence
    tokens = torch.tensor(sequence.token_ids)[None]
    prompt = ((tokens == IMAGE_TOKEN) & (torch.tensor(sequence.mask)[None] == 0)).int()
    images = sequence.images
    features = torch.cat(list(model.model.get_image_features(images.pixel_values, images.image_grid_thw).pooler_output))
    embeds = model.get_input_embeddings()(tokens).clone()
    embeds[prompt.bool()] = features.to(embeds.dtype)
    positions, _ = model.model.get_rope_index(tokens, mm_token_type_ids=prompt,
                                              image_grid_thw=sequence.images.image_grid_thw)  # fmt: skip
    text = torch.arange(tokens.shape[1])[None, None]
    logits = model(inputs_embeds=embeds, position_ids=torch.cat([text, positions]), use_cache=False).logits[0]
    logprobs = (logits / TEMPERATURE).log_softmax(-1)[:-1].gather(1, tokens[0, 1:, None]).squeeze(1)
    return logprobs[torch.tensor(sequence.mask[1:], dtype=torch.bool)]


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_a_completion_that_samples_the_placeholder_id_keeps_it_as_text(row_cls):
    """A model may sample the image placeholder's id (a random one does): that token is text, the image stays its
    prompt's run, and the row is not refused."""
    model = build_tiny_vlm(6, deltanet=False)
    x = make_images(model, [[1, 4, 4]], seed=7)
    prompt = SYSTEM + [6, VISION_START, *placeholders(x, 0), VISION_END, 7]
    samples = [make_sample(prompt + completion, len(prompt), 0, 0.5 - c, seed=c)
               for c, completion in enumerate([[IMAGE_TOKEN, 10, IMAGE_TOKEN], [11, IMAGE_TOKEN]])]  # fmt: skip
    for sample in samples:
        sample.sequence.images = copy.deepcopy(x)
    row = pack(samples, row_cls)
    reference = copy.deepcopy(model)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    expected = torch.cat([embedded_alone(reference, sample) for sample in row.samples])
    torch.testing.assert_close(packed, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("row_cls", [TreeRow, FlatRow])
def test_a_tool_results_image_after_a_trained_turn_is_an_image_of_the_sample(row_cls):
    """A multi-turn sample: the prompt's image, a trained turn, a tool result holding a second image (context), a
    second trained turn; two samples share the first turn, one of them also the tool's image."""
    model = build_tiny_vlm(7, deltanet=False)
    images = make_images(model, [[1, 4, 4], [1, 2, 6]], seed=8)
    prompt = SYSTEM + [6, VISION_START, *placeholders(images, 0), VISION_END, 7]
    turn, tool = [10, 11, 12], [8, VISION_START, *placeholders(images, 1), VISION_END, 9]
    samples = []
    for s, answer in enumerate([[13, 14], [15]]):
        tokens = prompt + turn + tool + answer
        sample = make_sample(tokens, len(prompt), 0, 0.7 - s, seed=s)
        start = len(prompt) + len(turn)
        sample.sequence.mask[start : start + len(tool)] = [0] * len(tool)  # the tool's result is context
        sample.sequence.sampler_logprobs[start : start + len(tool)] = [0.0] * len(tool)
        sample.sequence.images = copy.deepcopy(images)
        samples.append(sample)
    assert [len(packing_images.image_spans(sample)) for sample in samples] == [2, 2]
    row = pack(samples, row_cls)
    reference = copy.deepcopy(model)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    expected = torch.cat([embedded_alone(reference, sample) for sample in row.samples])
    torch.testing.assert_close(packed, expected, atol=1e-10, rtol=0)


def test_a_text_rows_dummy_image_runs_the_tower_once_and_changes_nothing():
    """A text row beside another rank's images (PackedRow.dummy_image): the vision tower runs once, on the smallest
    image, and backward reaches it with zero gradients; the log-probabilities and the text model's gradients are
    those of the row run as it is, bit for bit."""
    model = build_tiny_vlm(8, deltanet=False)
    text = [s for s in image_samples(model) if s.sequence.images is None]
    row = pack(text)
    dummy = copy.deepcopy(model)
    calls = []
    dummy.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["grid_thw"].tolist()), with_kwargs=True
    )
    plain = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    marked = packed_forward(dummy, dataclasses.replace(row, dummy_image=True), TEMPERATURE, attention="sdpa").logprobs
    assert torch.equal(plain, marked) and calls == [[[1, 2, 2]]]
    (row.advantages * plain).sum().backward()
    (row.advantages * marked).sum().backward()
    for (name, param), (_, other) in zip(model.named_parameters(), dummy.named_parameters(), strict=True):
        if name.startswith("model.visual."):
            assert param.grad is None and other.grad is not None and not other.grad.any(), name
        else:
            assert torch.equal(param.grad, other.grad), name
