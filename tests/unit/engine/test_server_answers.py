"""What the trainer makes of a rollout server's answer (engine/generation/servers.answer_row): each token's log-prob
and the weight version that sampled it, from vLLM's `weight_versions` spans (half-open over output positions)."""
import pytest

from rlhf_engine.engine.generation.servers import answer_row


def choice(tokens, logprobs, spans):
    return {"token_ids": tokens, "logprobs": {"content": [{"logprob": lp} for lp in logprobs]},
            "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in spans]}


def test_a_response_across_a_push_carries_each_tokens_version():
    tokens, lps, versions = answer_row(choice([7, 8, 9, 10], [-0.5, -1.0, -1.5, -2.0], [("3", 0, 1), ("4", 1, 4)]))
    assert (tokens, lps, versions) == ([7, 8, 9, 10], [-0.5, -1.0, -1.5, -2.0], [3, 4, 4, 4])


def test_one_version_for_every_token():
    assert answer_row(choice([7, 8], [-0.1, -0.2], [("0", 0, 2)]))[2] == [0, 0]
    assert answer_row(choice([], [], []))[2] == []  # an empty answer has nothing to stamp


@pytest.mark.parametrize("bad, says", [
    (choice([7, 8], [-0.1], [("1", 0, 2)]), "log-prob for every token"),
    (choice([7, 8], [-0.1, -0.2], [("default", 0, 2)]), "no version of this trainer"),  # never pushed to
    (choice([7, 8], [-0.1, -0.2], [("1", 0, 1)]), "no version of this trainer"),  # a span short of the answer
    (choice([7, 8], [-0.1, -0.2], []), "no version of this trainer"),
])
def test_an_answer_the_trainer_cannot_score_is_named(bad, says):
    with pytest.raises(ValueError, match=says):
        answer_row(bad)
