"""The built-in `math` reward against hand-written expectations: GSM8K `#### N`
references, MATH `\\boxed{}` references, LaTeX and plain numbers compared
symbolically; wrong answers, malformed and empty outputs score 0."""

from __future__ import annotations

import pytest

from hybrid_engine.envs.verifiers import math_reward, reference_answer

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"

CASES = [
    # (completion, reference answer, expected reward)
    # -- GSM8K references: the number after ####
    ("The answer is 72.", GSM8K_SOLUTION, 1.0),
    ("#### 72", GSM8K_SOLUTION, 1.0),
    ("She sold 24 in May, so 48 + 24 = 72 in total. #### 72", GSM8K_SOLUTION, 1.0),
    ("\\boxed{72}", GSM8K_SOLUTION, 1.0),
    ("72.0", GSM8K_SOLUTION, 1.0),
    ("The answer is 71.", GSM8K_SOLUTION, 0.0),
    ("#### 24", GSM8K_SOLUTION, 0.0),
    ("So the total is $72$.", "#### 72", 1.0),
    ("The total is 1000 dollars.", "#### 1,000", 1.0),
    ("The total is 1,000 dollars.", "#### 1000", 1.0),
    ("It costs -5 degrees.", "#### -5", 1.0),
    ("It is 5 degrees.", "#### -5", 0.0),
    ("\\boxed{0.25}", "#### 0.25", 1.0),
    ("\\boxed{\\frac{1}{4}}", "#### 0.25", 1.0),
    ("\\boxed{25\\%}", "#### 25", 1.0),
    # -- plain references
    ("\\boxed{18}", "18", 1.0),
    ("The answer is 18", "18", 1.0),
    ("I think it is 17.", "18", 0.0),
    ("\\boxed{18.5}", "18", 0.0),
    ("x = 18", "18", 1.0),
    ("\\boxed{3}", "3.0", 1.0),
    ("\\boxed{1/2}", "0.5", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{0.3333}", "1/3", 0.0),
    # -- MATH references: LaTeX, compared symbolically
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", 1.0),
    ("\\boxed{3\\sqrt{2}}", "3\\sqrt{2}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "3\\sqrt{2}", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{\\pi \\cdot 2}", "2\\pi", 1.0),
    ("\\boxed{6.28}", "2\\pi", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{(2,1)}", "(1, 2)", 0.0),
    ("\\boxed{[1,2)}", "[1, 2)", 1.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{\\frac{7}{3}}", "2\\frac{1}{3}", 1.0),
    ("The final answer is $\\boxed{5}$.", "\\boxed{5}", 1.0),
    ("First $x=3$, and then the answer is $\\boxed{7}$", "7", 1.0),
    ("\\boxed{7} but earlier I said 3", "3", 0.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "-0.75", 0.0),
    # -- malformed and empty outputs
    ("", "18", 0.0),
    ("   \n", "18", 0.0),
    ("\\boxed{", "18", 0.0),
    ("\\boxed{}", "18", 0.0),
    ("I do not know.", "18", 0.0),
    ("$$", "18", 0.0),
    ("\\frac{", "\\frac{1}{2}", 0.0),
    ("18", "", 0.0),  # no reference answer
    ("18", None, 0.0),
]


def test_there_are_at_least_fifty_cases() -> None:
    assert len(CASES) >= 50


@pytest.mark.parametrize(("completion", "answer", "expected"), CASES)
def test_math_reward(completion, answer, expected) -> None:
    assert math_reward("prompt", completion, answer) == expected


def test_the_reference_is_the_text_after_the_last_hashes() -> None:
    assert reference_answer(GSM8K_SOLUTION) == "72"
    assert reference_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"
