"""Find ``\\boxed{...}`` answers in model output, matching nested and escaped braces."""

from __future__ import annotations

import re

BOXED_START = re.compile(r"\\boxed\s*\{")


def closing_brace(text: str, start: int) -> int | None:
    """Index of the brace closing the group that opens just before ``start``; None if it never closes."""
    depth = 1
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # an escaped character, e.g. \{ or \}, never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def boxed_answers(text: str) -> list[str | None]:
    """Contents of every top-level ``\\boxed{...}`` in order; None for one whose brace never closes."""
    answers: list[str | None] = []
    position = 0
    while match := BOXED_START.search(text, position):
        end = closing_brace(text, match.end())
        if end is None:
            answers.append(None)
            break
        answers.append(text[match.end() : end])
        position = end + 1
    return answers


def last_boxed_answer(text: str) -> str | None:
    """The last complete ``\\boxed{...}`` content, the model's final answer by convention; None if there is none."""
    complete = [answer for answer in boxed_answers(text) if answer is not None]
    return complete[-1] if complete else None
