"""GRPO with a verifiable reward learns on the 2-core CPU: `launch/train_ppo.py --config examples/grpo_arithmetic.yaml`
(SmolLM2-135M-Instruct, 8 one-digit additions x 4 samples per iteration, exact_answer is 1 or 0; the score of an
iteration is the accuracy of its training rollouts). Needs the demo packages (scripts/install.sh --demo).

* The learning job (`bash scripts/test.sh --learning`): the example shortened to 10 iterations, seed 1234; the mean
  score of iterations 6-9 must exceed that of 0-3 by SHORT_MARGIN.
* Release (`--release`): the example's 12 iterations, and the same run at actor learning rate 0 (the control), which
  must not rise by GRPO_MARGIN.

Measured (2026-12-06, a 2-core Intel Xeon with AVX-512 and AMX, OMP_NUM_THREADS=1, the example's 12 iterations,
seeds 1234, 1 and 2): the gain of iterations 6-9 over 0-3 was 0.375, 0.367 and 0.398, and over the 12 iterations
(8-11 over 0-3) 0.52, 0.52 and 0.44. At learning rate 0 (seed 1234, stopped after 9 iterations) the scores stayed
at 0.32 +- 0.10 per iteration (0.41 .13 .34 .31 .19 .41 .38 .34 .34), and iterations 5-8 over 0-3 gained 0.07: a
trainer that does not learn gains 0 +- 0.07 over two 4-iteration means. SHORT_MARGIN 0.20 leaves 0.17 below the
weakest learning seed and about 2 standard deviations above a run that does not learn.
"""
import pytest

from _support import run_example

GRPO_MARGIN = 0.12  # the example's 12 iterations, last 4 over first 4: measured +0.44..0.52 over 3 seeds, -0.04 at lr 0
SHORT_MARGIN = 0.20  # 10 iterations, 6-9 over 0-3: measured +0.367..0.398 over 3 seeds (module docstring)


def _gain(records: list, k: int = 4) -> float:
    scores = [r["objective/score"] for r in records if "objective/score" in r]
    return sum(scores[-k:]) / k - sum(scores[:k]) / k


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(1800)  # about 3-4 minutes on the 2-core CPU (10 iterations of 17-25 s, and the start)
def test_grpo_arithmetic_learns_in_10_iterations(tmp_path):
    records = run_example("examples/grpo_arithmetic.yaml", str(tmp_path / "learn"), "--max_steps", "10")
    scores = [round(r["objective/score"], 3) for r in records if "objective/score" in r]
    assert len(scores) == 10, scores
    assert _gain(records) > SHORT_MARGIN, scores


@pytest.mark.slow
@pytest.mark.timeout(3000)  # two runs of about 5 minutes each on the 2-core CPU
def test_grpo_arithmetic_learns_and_not_at_lr0(tmp_path):
    gains = {name: _gain(run_example("examples/grpo_arithmetic.yaml", str(tmp_path / name), *extra))
             for name, extra in (("learn", []), ("lr0", ["--actor_learning_rate", "0"]))}
    print("gains", gains)
    assert gains["learn"] > GRPO_MARGIN, gains
    assert gains["lr0"] < GRPO_MARGIN, gains
