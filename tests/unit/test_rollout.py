"""The canonical rollout layout (rlhf_engine/rollout.py) against a plain per-row Python loop written here.

Every expected tensor is built row by row from lists, never with the tensor code under test. The indexing bugs these
tests guard against: trlx's left-padding-dependent position ids (the same token at a different absolute position in
the experience vs. the loss), DeepSpeed-Chat's reward placed one token off, and masks derived from `ids != pad`
(wrong when pad == EOS or BOS == pad).
"""
import pytest
import torch
from transformers import AutoTokenizer

from rlhf_engine.assets import train_tiny_tokenizer
from rlhf_engine.rollout import (Experience, Rollout, gather_at, last_token_index, pad_prompts,
                                 position_ids_from_mask)

PAD, EOS, STOP2 = 0, 9, 8  # ids used by the hand-made batches (pad != EOS unless a test says otherwise)


# ---- the reference: a straightforward per-row loop ---------------------------------------------------------------
def reference_layout(prompts: list[list[int]], responses_raw: list[list[int]], stops, pad: int,
                     prompt_masks: list[list[int]] | None = None) -> dict:
    """prompts: each row's real prompt tokens (no padding); responses_raw: what generate emitted for the row (any
    junk after the first stop included). Returns the layout as python lists."""
    P = max(len(p) for p in prompts)
    cut, ended = [], []
    for raw in responses_raw:
        resp = []
        for tok in raw:
            resp.append(tok)
            if tok in stops:
                break
        cut.append(resp)
        ended.append(bool(resp) and resp[-1] in stops)
    R = max(len(r) for r in cut)
    out = {k: [] for k in ("sequences", "attention_mask", "position_ids", "action_mask")}
    for b, (prompt, resp) in enumerate(zip(prompts, cut)):
        n_left = P - len(prompt)
        pmask = prompt_masks[b] if prompt_masks else [1] * len(prompt)
        seq = [pad] * n_left + list(prompt) + list(resp) + [pad] * (R - len(resp))
        mask = [0] * n_left + list(pmask) + [1] * len(resp) + [0] * (R - len(resp))
        pos, nxt = [], 0
        for m in mask:  # a real token takes the next position; padding: 0 on the left, the last position on the right
            if m:
                pos.append(nxt)
                nxt += 1
            else:
                pos.append(max(nxt - 1, 0))
        out["sequences"].append(seq)
        out["attention_mask"].append(mask)
        out["position_ids"].append(pos)
        out["action_mask"].append([1] * len(resp) + [0] * (R - len(resp)))
    out["response_lengths"] = [len(r) for r in cut]
    out["ended_with_eos"] = ended
    out["P"], out["R"] = P, R
    return out


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def right_pad(rows: list[list[int]], value: int) -> torch.Tensor:
    G = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (G - len(r)) for r in rows])


def assert_layout(r: Rollout, exp: dict) -> None:
    assert r.prompt_length == exp["P"] and r.response_width == exp["R"]
    for name in ("sequences", "attention_mask", "position_ids", "action_mask", "response_lengths"):
        got = getattr(r, name).tolist()
        assert got == exp[name], f"{name}: got {got}, expected {exp[name]}"
    assert r.ended_with_eos.tolist() == exp["ended_with_eos"]
    assert r.sequences.shape == r.attention_mask.shape == r.position_ids.shape == (len(exp["sequences"]),
                                                                                    exp["P"] + exp["R"])


PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33], [41]]
RESPONSES = {
    # an early EOS with junk and a second EOS after it / truncated (no EOS, length G) / EOS first (length 1) /
    # a second stop token id ends the row, random junk after it
    "mixed": [[51, 52, EOS, 53, EOS, 77], [61, 62, 63, 64, 65, 66], [EOS, 71, 72, 73, 74, 75],
              [81, STOP2, 82, EOS, 83, 84]],
    # nobody is truncated: R is trimmed to the longest response (3) although G = 6
    "all_end_early": [[51, EOS, 55, 56, 57, 58], [61, 62, EOS, 9, 9, 9], [EOS, 1, 2, 3, 4, 5], [81, STOP2, 0, 0, 0, 0]],
}


@pytest.mark.parametrize("case", sorted(RESPONSES))
@pytest.mark.parametrize("with_prompt", [False, True])
def test_from_generation_matches_per_row_loop(case, with_prompt):
    raw = RESPONSES[case]
    prompt_ids, prompt_mask = left_pad(PROMPTS, PAD)
    gen = right_pad(raw, PAD)
    if with_prompt:  # what HF generate returns for decoder-only models
        gen = torch.cat([prompt_ids, gen], 1)
    r = Rollout.from_generation(prompt_ids, prompt_mask, gen, [EOS, STOP2], PAD)
    exp = reference_layout(PROMPTS, raw, {EOS, STOP2}, PAD)
    assert_layout(r, exp)
    assert exp["R"] == (6 if case == "mixed" else 3)
    if case == "mixed":
        assert exp["response_lengths"] == [3, 6, 1, 2] and exp["ended_with_eos"] == [True, False, True, True]
    # tokens after the first stop are pad and masked, whatever they were
    assert r.sequences[0, r.prompt_length + 3:].tolist() == [PAD] * (r.response_width - 3)
    assert r.responses.tolist() == [row[exp["P"]:] for row in exp["sequences"]]
    assert r.prompts.tolist() == prompt_ids.tolist()


def test_real_tokens_get_positions_0_to_n_minus_1_whatever_the_left_padding():
    """trlx's bug: the same prompt + response at a different left padding got different absolute positions."""
    prompt, resp = [5, 6, 7], [17, 18, EOS]
    alone = Rollout.from_generation(*left_pad([prompt], PAD), torch.tensor([resp]), [EOS], PAD)
    for longer in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):
        ids, mask = left_pad([prompt, longer], PAD)
        batch = Rollout.from_generation(ids, mask, right_pad([resp, [20, 21, 22, 23, 24]], PAD), [EOS], PAD)
        real = batch.attention_mask[0].bool()
        assert batch.sequences[0][real].tolist() == prompt + resp
        assert batch.position_ids[0][real].tolist() == [0, 1, 2, 3, 4, 5]
        assert batch.position_ids[0][real].tolist() == alone.position_ids[0][alone.attention_mask[0].bool()].tolist()


def test_pad_equals_eos_keeps_the_real_eos():
    pad = eos = 0
    prompt_ids, prompt_mask = left_pad([[5, 6], [7]], pad)
    gen = torch.tensor([[11, eos, eos, eos], [12, 13, 14, eos]])  # row 0: EOS then the pad(=EOS) filler
    r = Rollout.from_generation(prompt_ids, prompt_mask, gen, [eos], pad)
    exp = reference_layout([[5, 6], [7]], gen.tolist(), {eos}, pad)
    assert_layout(r, exp)
    P = r.prompt_length
    assert r.sequences[0, P + 1] == pad and r.attention_mask[0, P + 1] == 1  # the EOS: pad id, but a real token
    assert r.attention_mask[0, P + 2:].tolist() == [0, 0]  # the filler after it is padding
    assert r.response_lengths.tolist() == [2, 4] and r.ended_with_eos.tolist() == [True, True]
    assert r.score_index().tolist() == [P + 1, P + 3]  # the score is read at the EOS itself


def test_bos_equals_pad_mask_comes_from_the_tokenizer_not_from_ids():
    pad = bos = 1
    prompts = [[bos, 7, 8], [bos, 5, 6, 7, 8]]
    prompt_ids, prompt_mask = left_pad(prompts, pad)  # the tokenizer's mask: BOS is real
    assert prompt_ids[0].tolist() == [1, 1, 1, 7, 8] and prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    r = Rollout.from_generation(prompt_ids, prompt_mask, torch.tensor([[20, EOS], [21, 22]]), [EOS], pad)
    assert_layout(r, reference_layout(prompts, [[20, EOS], [21, 22]], {EOS}, pad))
    assert r.attention_mask[0, 2] == 1  # the BOS, although its id is the pad id
    assert r.position_ids[0].tolist() == [0, 0, 0, 1, 2, 3, 4]  # BOS at 0, 7 at 1, 8 at 2, responses 3, 4
    # negative control: a mask derived from ids != pad drops the BOS and shifts every later position by one
    wrong = position_ids_from_mask((r.sequences != pad).long())
    assert wrong[0].tolist() == [0, 0, 0, 0, 1, 2, 3]
    assert wrong[0].tolist() != r.position_ids[0].tolist()


def test_action_slice_and_score_index_on_a_concrete_batch():
    # P = 4. Row 0: prompt [0 0 a b], response [x y EOS] -> len 3.  Row 1: prompt [a b c d], response [EOS] -> len 1.
    # Row 2: prompt [0 a b c], response [w x y z] truncated -> len 4.  R = 4, L = 8.
    prompts = [[101, 102], [201, 202, 203, 204], [301, 302, 303]]
    raw = [[11, 12, EOS, 13], [EOS, 21, 22, 23], [31, 32, 33, 34]]
    r = Rollout.from_generation(*left_pad(prompts, PAD), torch.tensor(raw), [EOS], PAD)
    assert (r.prompt_length, r.response_width) == (4, 4)
    assert r.response_lengths.tolist() == [3, 1, 4]
    # A per-position tensor whose value at sequence position i is i: action t is predicted at P - 1 + t = 3 + t.
    per_position = torch.arange(8).expand(3, 8)
    assert r.action_slice(per_position).tolist() == [[3, 4, 5, 6]] * 3
    # ... and with a trailing feature dim (logits [B, L, V])
    assert r.action_slice(per_position.unsqueeze(-1).expand(3, 8, 2))[..., 1].tolist() == [[3, 4, 5, 6]] * 3
    # the position after each sliced one holds the response token it predicts
    assert r.sequences.gather(1, r.action_slice(per_position) + 1).tolist() == r.responses.tolist()
    # score at the last real token P + len - 1: row 0 4+3-1 = 6 (the EOS), row 1 4+1-1 = 4 (the EOS),
    # row 2 4+4-1 = 7 (the last token of a truncated row)
    assert r.score_index().tolist() == [6, 4, 7]
    assert r.sequences[torch.arange(3), r.score_index()].tolist() == [EOS, EOS, 34]
    # negative control: one past it (DeepSpeed-Chat's off-by-one family) reads padding in the rows that ended early
    past = (r.score_index() + 1).clamp(max=7)
    assert r.attention_mask[torch.arange(3), past].tolist() == [0, 0, 1]


def test_last_token_index_and_gather_at():
    mask = torch.tensor([[0, 0, 1, 1, 1],  # left padded -> 4
                         [1, 1, 0, 0, 0],  # right padded -> 1
                         [0, 1, 1, 0, 0],  # both -> 2
                         [1, 1, 1, 1, 1],  # none -> 4
                         [0, 0, 0, 0, 0]])  # no real token -> 0
    assert last_token_index(mask).tolist() == [4, 1, 2, 4, 0]
    assert last_token_index(mask.bool()).tolist() == [4, 1, 2, 4, 0]
    values = torch.arange(25.).reshape(5, 5)
    idx = torch.tensor([4, 1, 2, 4, 0])
    assert gather_at(values, idx).tolist() == [4., 6., 12., 19., 20.]
    assert gather_at(values.unsqueeze(-1), idx).tolist() == [4., 6., 12., 19., 20.]  # [B, L, 1] value heads


def _rollout(prompts, raw, stops=(EOS,)):
    return Rollout.from_generation(*left_pad(prompts, PAD), right_pad(raw, PAD), list(stops), PAD)


def test_select_and_split_keep_P_R_and_positions():
    r = _rollout(PROMPTS, RESPONSES["mixed"], (EOS, STOP2))
    sub = r.select([2, 0])
    assert (sub.prompt_length, sub.response_width) == (r.prompt_length, r.response_width)
    for name in ("sequences", "attention_mask", "position_ids", "action_mask", "response_lengths", "ended_with_eos"):
        assert getattr(sub, name).tolist() == [getattr(r, name)[2].tolist(), getattr(r, name)[0].tolist()]
    parts = r.split(3)
    assert [p.batch_size for p in parts] == [3, 1]
    assert all((p.prompt_length, p.response_width) == (5, 6) for p in parts)
    assert torch.equal(torch.cat([p.position_ids for p in parts]), r.position_ids)
    assert torch.equal(parts[1].sequences[0], r.sequences[3])


def _real(r: Rollout, b: int) -> tuple[list, list]:
    keep = r.attention_mask[b].bool()
    return r.sequences[b][keep].tolist(), r.position_ids[b][keep].tolist()


def test_rollout_cat_repads_and_keeps_every_real_token_and_position():
    a = _rollout([[11, 12], [13]], [[21, EOS, 5], [22, 23, 24]])  # P = 2, R = 3
    b = _rollout([[31, 32, 33, 34, 35], [36, 37]], [[EOS, 1], [41, 42]])  # P = 5, R = 2
    assert (a.prompt_length, a.response_width, b.prompt_length, b.response_width) == (2, 3, 5, 2)
    c = Rollout.cat([a, b], PAD)
    assert (c.prompt_length, c.response_width, c.batch_size) == (5, 3, 4)
    for row, (src, i) in enumerate([(a, 0), (a, 1), (b, 0), (b, 1)]):
        assert _real(c, row) == _real(src, i), f"row {row}"
        n_prompt = int(src.attention_mask[i, :src.prompt_length].sum())
        n_resp = int(src.response_lengths[i])
        # prompts end right before column P (left padded), responses start at P (right padded)
        expected_mask = [0] * (5 - n_prompt) + [1] * n_prompt + [1] * n_resp + [0] * (3 - n_resp)
        assert c.attention_mask[row].tolist() == expected_mask
        assert c.responses[row, :n_resp].tolist() == src.responses[i, :n_resp].tolist()
        assert c.sequences[row][~c.attention_mask[row].bool()].tolist() == [PAD] * (8 - n_prompt - n_resp)
    assert torch.equal(c.position_ids, position_ids_from_mask(c.attention_mask))
    assert c.response_lengths.tolist() == [2, 3, 1, 2] and c.ended_with_eos.tolist() == [True, False, True, False]
    assert torch.equal(c.action_mask, c.attention_mask[:, 5:])


def _experience(r: Rollout, fill: float) -> Experience:
    per_action = {n: torch.full((r.batch_size, r.response_width), fill) * r.action_mask for n in Experience._PER_ACTION}
    return Experience(rollout=r, scores=torch.full((r.batch_size,), fill), **per_action)


def test_experience_cat_pads_per_action_tensors_with_zero_on_the_right():
    a = _rollout([[11, 12]], [[21, 22, 23, 24]])  # R = 4
    b = _rollout([[31], [32, 33, 34]], [[EOS], [41, EOS]])  # R = 2
    x = Experience.cat([_experience(a, 1.0), _experience(b, 2.0)], PAD)
    assert x.rollout.response_width == 4 and x.batch_size == 3
    for name in Experience._PER_ACTION:
        assert getattr(x, name).tolist() == [[1., 1., 1., 1.], [2., 0., 0., 0.], [2., 2., 0., 0.]], name
    assert x.scores.tolist() == [1., 2., 2.]
    parts = x.split(2)
    assert [p.batch_size for p in parts] == [2, 1] and parts[1].values.tolist() == [[2., 2., 0., 0.]]
    assert parts[1].rollout.response_width == 4


def test_pad_prompts():
    ids, mask = pad_prompts([[5, 6, 7], [8]], pad_token_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    # BOS == pad: a given mask is kept as it is (the BOS with the pad id stays real)
    ids, mask = pad_prompts([[1, 5], [1, 6, 7]], 1, attention_masks=[[1, 1], [1, 1, 1]])
    assert ids.tolist() == [[1, 1, 5], [1, 6, 7]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    with pytest.raises(ValueError, match="empty batch"):
        pad_prompts([], 0)
    with pytest.raises(ValueError, match=r"attention_masks\[1\]"):
        pad_prompts([[5], [6, 7]], 0, attention_masks=[[1], [1]])


@pytest.mark.parametrize("prompt_mask,gen,match", [
    ([[1, 1, 0], [0, 1, 1]], [[4, EOS], [5, EOS]], "prompt_attention_mask.*left-padded"),  # right padded
    ([[0, 2, 1], [0, 1, 1]], [[4, EOS], [5, EOS]], "prompt_attention_mask.*0 and 1"),
    ([[0, 1], [0, 1]], [[4, EOS], [5, EOS]], "prompt_attention_mask"),  # [B, 2] vs prompt ids [B, 3]
    ([[0, 1, 1], [0, 1, 1]], [[4, EOS]], "generated_ids"),  # one row for a batch of two
    ([[0, 1, 1], [0, 1, 1]], [4, EOS], "generated_ids"),  # 1-D
    ([[0, 1, 1], [0, 0, 0]], [[4, EOS], [5, EOS]], "prompt_attention_mask.*real prompt token"),  # empty prompt
])
def test_bad_input_raises_value_error_naming_the_argument(prompt_mask, gen, match):
    prompt_ids = torch.tensor([[0, 2, 3], [0, 5, 6]])
    with pytest.raises(ValueError, match=match):
        Rollout.from_generation(prompt_ids, torch.tensor(prompt_mask), torch.tensor(gen), [EOS], PAD)


def test_bad_input_prompt_only_and_shapes():
    ids, mask = left_pad([[2, 3], [4, 5]], PAD)
    with pytest.raises(ValueError, match="generated_ids"):  # generate returned the prompt only
        Rollout.from_generation(ids, mask, ids.clone(), [EOS], PAD)
    with pytest.raises(ValueError, match="prompt_ids"):
        Rollout.from_generation(ids[0], mask[0], torch.tensor([[4, EOS]]), [EOS], PAD)
    with pytest.raises(ValueError, match="generated_ids.*includes_prompt"):
        Rollout.from_generation(ids, mask, torch.tensor([[7, 8, 9], [7, 8, 9]]), [EOS], PAD, includes_prompt=True)


def test_includes_prompt_resolves_a_response_that_repeats_its_prompt():
    # P = 1 and a response-only batch whose first token equals the prompt token: detection would strip it
    ids, mask = torch.tensor([[7], [7]]), torch.tensor([[1], [1]])
    gen = torch.tensor([[7, 8, EOS], [7, EOS, PAD]])
    auto = Rollout.from_generation(ids, mask, gen, [EOS], PAD)
    assert auto.response_lengths.tolist() == [2, 1]  # the ambiguous guess: a leading 7 taken for the prompt
    explicit = Rollout.from_generation(ids, mask, gen, [EOS], PAD, includes_prompt=False)
    assert explicit.responses.tolist() == [[7, 8, EOS], [7, EOS, PAD]]
    assert explicit.response_lengths.tolist() == [3, 2]


@pytest.fixture(scope="module")
def tok_pad_is_eos(tmp_path_factory):
    return AutoTokenizer.from_pretrained(train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok_eos")), pad_is_eos=True))


def test_real_tokenizer_left_padded_prompts_keep_their_positions(tok_pad_is_eos):
    tok = tok_pad_is_eos
    assert tok.pad_token_id == tok.eos_token_id
    texts = ["def sort a list of numbers in place", "hello", "the quick brown fox"]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    singles = [tok(t)["input_ids"] for t in texts]
    assert len({len(s) for s in singles}) == 3  # different lengths: real left padding
    eos = tok.eos_token_id
    answers = [tok(" yes")["input_ids"] + [eos, eos, eos], tok(" no way")["input_ids"] + [eos],
               tok(" maybe so and so on and on")["input_ids"]]
    G = max(len(a) for a in answers)
    answers = [a + [eos] * (G - len(a)) for a in answers]  # generate's filler for finished rows is pad == EOS
    gen = torch.cat([batch["input_ids"], torch.tensor(answers)], 1)  # prompt in front, as generate returns it
    r = Rollout.from_generation(batch["input_ids"], batch["attention_mask"], gen, [eos], tok.pad_token_id)
    exp = reference_layout(singles, answers, {eos}, tok.pad_token_id)
    assert_layout(r, exp)
    for b, single in enumerate(singles):
        n = len(single) + int(r.response_lengths[b])
        real = r.attention_mask[b].bool()
        assert r.sequences[b][real].tolist()[:len(single)] == single
        assert r.position_ids[b][real].tolist() == list(range(n))  # 0..n-1 whatever the padding
    assert r.ended_with_eos.tolist() == [True, True, False]
    assert r.sequences[0, r.score_index()[0]] == eos and r.attention_mask[0, r.score_index()[0]] == 1


def test_real_tokenizer_bos_is_pad(tmp_path):
    tok = AutoTokenizer.from_pretrained(train_tiny_tokenizer(str(tmp_path), pad_is_eos=False, bos_is_pad=True))
    assert tok.bos_token_id == tok.pad_token_id
    texts = [tok.bos_token + "short", tok.bos_token + "a somewhat longer prompt"]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    assert batch["input_ids"][0, 0] == tok.pad_token_id  # row 0 is left-padded with the pad (== BOS) id
    assert batch["attention_mask"][0].sum() < batch["input_ids"].shape[1]
    gen = torch.tensor([[40, tok.eos_token_id], [41, 42]])
    r = Rollout.from_generation(batch["input_ids"], batch["attention_mask"], gen, [tok.eos_token_id], tok.pad_token_id)
    for b, text in enumerate(texts):
        single = tok(text)["input_ids"]
        assert single[0] == tok.bos_token_id
        real = r.attention_mask[b].bool()
        assert r.sequences[b][real].tolist()[:len(single)] == single  # the BOS (== pad id) is kept as real
        assert r.position_ids[b][real].tolist() == list(range(len(single) + 2))
    wrong = position_ids_from_mask((r.sequences != tok.pad_token_id).long())  # negative control
    assert not torch.equal(wrong, r.position_ids)


def test_trimmed_drops_the_columns_every_row_pads_and_keeps_positions():
    # P = 3: rows [0 a b], [a b c], [0 0 a]; R = 4 (row 1 ran to the limit). Rows 0 and 2 alone: their first prompt
    # column is padding in both, and their longest response is 2 tokens.
    prompts = [[101, 102], [201, 202, 203], [301]]
    raw = [[11, EOS, 12, 13], [21, 22, 23, 24], [EOS, 31, 32, 33]]
    full = Rollout.from_generation(*left_pad(prompts, PAD), torch.tensor(raw), [EOS], PAD)
    r = full.select([0, 2])
    assert (r.prompt_length, r.response_width) == (3, 4)
    t = r.trimmed()
    assert (t.prompt_length, t.response_width) == (2, 2)  # 1 prompt column no row uses, 2 response columns
    assert t.sequences.tolist() == [[101, 102, 11, EOS], [PAD, 301, EOS, PAD]]
    assert t.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]
    assert t.action_mask.tolist() == [[1, 1], [1, 0]]
    # every real token keeps its position id, and the score and action positions name the same tokens
    real = r.attention_mask.bool()
    assert t.position_ids[t.attention_mask.bool()].tolist() == r.position_ids[real].tolist()
    assert t.sequences.gather(1, t.score_index()[:, None]).tolist() == \
        r.sequences.gather(1, r.score_index()[:, None]).tolist()
    assert torch.equal(t.responses * t.action_mask, (r.responses * r.action_mask)[:, :2])
    # nothing to trim: the same object
    dense = Rollout.from_generation(*left_pad([[1, 2], [3, 4]], PAD), torch.tensor([[11, 12], [21, EOS]]), [EOS], PAD)
    assert dense.trimmed() is dense
