"""Finding \\boxed{} answers with nested and escaped braces."""

from __future__ import annotations

import pytest

from asyncrl.rewards.boxed import boxed_answers, last_boxed_answer


@pytest.mark.parametrize(
    ("text", "answers"),
    [
        (r"so \boxed{42}.", ["42"]),
        (r"\boxed{\frac{1}{2}}", [r"\frac{1}{2}"]),
        (r"\boxed{\{1, 2, 3\}}", [r"\{1, 2, 3\}"]),
        (r"\boxed{\left\{ x \right\}}", [r"\left\{ x \right\}"]),
        (r"\boxed {7} and \boxed{8}", ["7", "8"]),
        (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", [r"\begin{pmatrix}1\\2\end{pmatrix}"]),
        (r"\boxed{\boxed{5}}", [r"\boxed{5}"]),
        (r"\boxed{3} then \boxed{\frac{1}{", ["3", None]),
        (r"\boxed{}", [""]),
        (r"no answer, \fbox{3}, boxed{4}", []),
    ],
)
def test_boxed_answers(text, answers):
    assert boxed_answers(text) == answers


def test_last_boxed_answer_skips_an_unclosed_one():
    assert last_boxed_answer(r"first \boxed{1}, finally \boxed{2}") == "2"
    assert last_boxed_answer(r"\boxed{3} then \boxed{\frac{1}{") == "3"
    assert last_boxed_answer("no box") is None
