"""The reward of the README's "Your own task" walk-through (tests/test_registry.py checks it)."""

from asyncrl.rewards.base import final_answer_text


def exact_answer(prompts, completions, completion_ids, *, answer, ignore_case=True, **columns):
    """1.0 where the completion's last assistant message is the row's answer, else 0.0."""
    texts = [final_answer_text(completion).strip() for completion in completions]
    if ignore_case:
        return [float(text.lower() == expected.lower()) for text, expected in zip(texts, answer, strict=True)]
    return [float(text == expected) for text, expected in zip(texts, answer, strict=True)]
