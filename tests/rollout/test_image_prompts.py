"""Images in prompts on the rollout side (rollout/images.py): a row's images decoded once into its conversation, sent
as data URLs, and a turn through a real built-in server whose prompt tokens and patches reach the trainer's sample.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from asyncrl.client import GenerationClient
from asyncrl.config.compose import compose, to_config
from asyncrl.prompts import render_prompt
from asyncrl.rollout.images import (
    ImageProcessing,
    data_url,
    decode_image,
    image_processing,
    place_row_images,
    prompt_images,
    request_messages,
    row_images,
    template_messages,
    with_images,
)
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.rollout.reconcile import reconcile
from asyncrl.serving.command import served_name
from asyncrl.serving.process import ServerProcess
from tests.conftest import serve_session

QUESTION = [{"role": "user", "content": "How many squares?"}]


def square(size: tuple[int, int] = (40, 24), color: str = "red") -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(color, (4, 4, 12, 12))
    return image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm_server(
    random_tiny_vlm_dir: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The built-in server on the tiny vision-language checkpoint that takes images."""
    yield from serve_session(random_tiny_vlm_dir, weights_root, tmp_path_factory.mktemp("image-server"))


def test_an_image_column_value_of_each_form_decodes_to_rgb(tmp_path):
    image = square()
    (tmp_path / "a.png").write_bytes(png(image))
    forms = [image.convert("L"), png(image), {"bytes": png(image), "path": None}, {"bytes": None, "path": "a.png"},
             "a.png", str(tmp_path / "a.png")]  # fmt: skip
    for value in forms:
        decoded = decode_image(value, tmp_path)
        assert decoded.mode == "RGB" and decoded.size == image.size
    assert [i.size for i in row_images({"images": [png(image), png(square((8, 8)))]})] == [(40, 24), (8, 8)]
    assert row_images({"image": None, "prompt": QUESTION}) == []
    with pytest.raises(ValueError, match="an image column value of type int"):
        decode_image(3)


def test_images_go_before_the_first_user_messages_text_or_into_its_bare_image_parts():
    a, b = square(), square(color="blue")
    placed = with_images([{"role": "system", "content": "Count."}, *QUESTION], [a, b])
    assert placed[0] == {"role": "system", "content": "Count."}
    assert placed[1]["content"] == [{"type": "image", "image": a}, {"type": "image", "image": b},
                                    {"type": "text", "text": "How many squares?"}]  # fmt: skip
    bare = [{"role": "user", "content": [{"type": "text", "text": "left"}, {"type": "image"}, {"type": "image"}]}]
    filled = with_images(bare, [a, b])
    assert [part.get("image") for part in filled[0]["content"]] == [None, a, b]
    assert bare[0]["content"][1] == {"type": "image"}  # the row's own messages are left as they were
    assert prompt_images(filled) == [a, b] and prompt_images("plain text") == []
    with pytest.raises(ValueError, match="a prompt with 2 image parts and 1 images"):
        with_images(bare, [a])
    with pytest.raises(ValueError, match="no user message"):
        with_images([{"role": "system", "content": "x"}], [a])


def test_a_request_sends_each_image_as_a_lossless_data_url_and_the_template_sees_placeholders():
    image = square()
    placed = with_images(QUESTION, [image])
    url = data_url(image)
    sent = request_messages(placed, [url])
    assert sent[0]["content"][0] == {"type": "image_url", "image_url": {"url": url}}
    assert sent[0]["content"][1] == {"type": "text", "text": "How many squares?"}
    header, _, data = url.partition(",")
    assert header == "data:image/png;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).tobytes() == image.tobytes()
    assert template_messages(placed)[0]["content"][0] == {"type": "image"}


def test_a_rows_images_are_decoded_once_for_its_group(tmp_path):
    (tmp_path / "a.png").write_bytes(png(square()))
    row = {"prompt": QUESTION, "image": "a.png", "solution": "1"}
    placed = place_row_images(row, tmp_path)
    assert placed["solution"] == "1" and row["prompt"] == QUESTION
    (image,) = prompt_images(placed["prompt"])
    copies = [[dict(m) for m in placed["prompt"]] for _ in range(8)]  # each rollout's own messages, as Agents makes
    assert all(prompt_images(copy) == [image] for copy in copies)  # the same image object: prepared once
    parts = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}
    assert prompt_images(place_row_images(parts, tmp_path)["prompt"])[0].size == (40, 24)
    assert place_row_images({"prompt": "text"}, tmp_path) == {"prompt": "text"}


def test_the_checkpoints_processor_makes_the_patches_once_per_prompt_and_checks_the_servers_placeholders(
    random_tiny_vlm_dir,
):
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}"]))
    processing = image_processing(config)
    images = [square(), square((56, 56))]
    urls, patches = processing.prepare(images)
    assert processing.prepare(images)[1] is patches and len(urls) == 2
    assert patches.token_id == processing.token_id and patches.image_grid_thw.shape == (2, 3)
    merged = (patches.image_grid_thw.prod(-1) // processing.merge_size**2).tolist()
    rendered = [5, processing.token_id, 6, processing.token_id, 7]
    assert patches.expand(rendered) == [5, *[processing.token_id] * merged[0], 6,
                                        *[processing.token_id] * merged[1], 7]  # fmt: skip
    processing.check(patches.expand(rendered), patches)
    with pytest.raises(ValueError, match=rf"has {sum(merged) - 1} image placeholder tokens .* makes {sum(merged)}"):
        processing.check(patches.expand(rendered)[2:], patches)  # one placeholder less
    with pytest.raises(ValueError, match="without image_token_id"):
        ImageProcessing.load(str(random_tiny_vlm_dir), type("Text", (), {})())


def test_a_turn_with_images_goes_through_the_server_and_its_sample_carries_the_patches(random_tiny_vlm_dir, vlm_server):
    """The real built-in server renders the conversation and expands the images; the turn's prompt is its tokens,
    which the patches' grids account for, and reconciliation hands the patches to the training sample."""
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", "sampling.max_completion_length=6",
                                "sampling.num_sampler_logprobs=2"]))  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(random_tiny_vlm_dir)
    prompt = with_images(QUESTION, [square(), square((24, 56), "green")])

    async def one() -> list:
        async with GenerationClient(vlm_server.base_url, served_name(str(random_tiny_vlm_dir)), timeout_s=60) as client:
            loop = AsyncRolloutLoop(config, tokenizer, client, advantage_fn=None, max_model_len=256)
            return [await loop.generate_one(prompt, tools=[]) for _ in range(2)]

    rollouts = asyncio.run(one())
    processing = image_processing(config)
    for rollout in rollouts:
        (turn,) = rollout.turns
        assert turn.images is not None and turn.images.image_grid_thw.shape == (2, 3)
        expected = turn.images.expand(render_prompt(tokenizer, template_messages(prompt), {}))
        assert turn.prompt_ids == expected
        assert len(turn.output_ids) == len(turn.output_log_probs) > 0
        assert turn.output_sampler_logprobs is not None and all(len(top) == 2 for top in turn.output_sampler_logprobs)
        assert rollout.completion[0]["role"] == "assistant"
        (sequence,) = reconcile(rollout.turns)
        assert sequence.images is turn.images and sequence.token_ids[: len(expected)] == expected
        assert torch.equal(sequence.images.pixel_values, processing.patches(prompt_images(prompt)).pixel_values)


def test_a_tool_that_returns_content_blocks_with_an_image_gives_them_to_the_next_turn():
    """TRL's multimodal tool responses: a list of image and text blocks becomes the tool message's content parts
    (the image decoded); a block of another kind is the call's failure, not the rollout's."""
    from asyncrl.rollout.tools import ToolCall, ToolStats, run_tool_calls

    def screenshot(region: str) -> list:
        """Grab a region.

        Args:
            region: which one
        """
        return [{"type": "image", "image": square(color="green")}, {"type": "text", "text": f"{region} grabbed"}]

    def broken(region: str) -> list:
        """Return a bad block.

        Args:
            region: which one
        """
        return [{"type": "image", "image": square()}, {"type": "audio"}]

    stats = ToolStats()
    calls = [ToolCall("screenshot", {"region": "top"}), ToolCall("broken", {"region": "top"})]
    good, bad = asyncio.run(run_tool_calls(calls, {"screenshot": screenshot, "broken": broken}, None, stats))
    (image,) = prompt_images([good])
    assert good["content"][1] == {"type": "text", "text": "top grabbed"} and image.mode == "RGB"
    assert bad["content"].startswith("Error: broken returned") and stats.failures == 1


def test_a_tool_results_image_joins_the_next_turns_images_and_the_training_sample(random_tiny_vlm_dir, vlm_server):
    """After a tool result with an image, the next turn goes through the server with both images (and the tools'
    schemas, for the template only); its sample holds both images' patches."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.tools import tool_schemas

    def look(region: str) -> str:
        """Look.

        Args:
            region: where
        """
        return region

    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", "sampling.max_completion_length=4"]))
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_vlm_dir)
    prompt = with_images(QUESTION, [square()])
    schemas = tool_schemas([look])

    async def two_turns() -> list:
        async with GenerationClient(vlm_server.base_url, served_name(str(random_tiny_vlm_dir)), timeout_s=60) as client:
            loop = AsyncRolloutLoop(config, tokenizer, client, advantage_fn=None, max_model_len=256)
            ids, images = loop.render_conversation(prompt, schemas)
            first = await loop.generate_image_turn(prompt, schemas, ids, images)
            reply = {"role": "assistant", "content": tokenizer.decode(first.output_ids, skip_special_tokens=True)}
            tool = {"role": "tool", "name": "look", "content": [{"type": "image", "image": square((56, 32), "blue")},
                                                                {"type": "text", "text": "here"}]}  # fmt: skip
            conversation = [*prompt, reply, tool]
            ids, images = loop.render_conversation(conversation, schemas)
            return [first, await loop.generate_image_turn(conversation, schemas, ids, images)]

    first, second = asyncio.run(two_turns())
    assert first.images.image_grid_thw.shape == (1, 3) and second.images.image_grid_thw.shape == (2, 3)
    *_, last = reconcile([first, second])
    assert last.images is second.images
    from asyncrl.packing.images import image_spans
    from asyncrl.rollout.types import RolloutSample

    sample = RolloutSample(sequence=last, advantage=1.0, reward=1.0, group_id=0, row_index=0, prompt_index=0,
                           model_version=0, rollout_id="r")  # fmt: skip
    assert len(image_spans(sample)) == 2  # both images' placeholders are the sample's context
