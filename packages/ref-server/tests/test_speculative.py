"""The MTP module and speculative decoding (CPU): the cached module against its full pass,
greedy output against plain greedy, the rejection rule's distribution (chi-square)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

import ref_server.model as M
import ref_server.model.speculative as S
from ref_server.model import SamplingParams, StepBatch
from ref_server.model.cache import PagedKVCache
from ref_server.model.checkpoint import checkpoint_tensors, read_config


def test_the_cached_module_matches_its_full_pass():
    model = M.from_preset("tiny", mtp=True, seed=3)
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        embedded = model.embed_tokens(ids[:, 1:])
        rotation = model.full_pass_rotation(ids[:, :-1])
        want = model.lm_head(model.mtp.full_pass(embedded, hidden[:, :-1], rotation))[0]
    cache = PagedKVCache(model.args, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    # the model over the first 20 tokens, then the module: 17 rows at once, then one by one
    _, got_hidden = model.every_row_step(StepBatch(ids[0, :20], [20], [20], table), cache)
    assert (got_hidden - hidden[0, :20]).abs().max() < 0.02 * hidden.abs().max()
    rows = [model.every_row_step(StepBatch(ids[0, 1:18], [17], [17], table), cache, hidden[0, :17])]
    for i in range(17, 20):
        step = StepBatch(ids[0, i + 1 : i + 2], [1], [i + 1], table)
        rows.append(model.every_row_step(step, cache, hidden[0, i : i + 1]))
    got = torch.cat([logits for logits, _ in rows])
    assert got.shape == want.shape
    # the bf16 cache rounds the latent
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_a_model_without_the_module_refuses_to_speculate():
    with pytest.raises(ValueError, match="MTP module"):
        S.generate_speculative(M.from_preset("tiny"), [[1, 2]])
    with pytest.raises(ValueError, match="draft_tokens must be 1 to 3"):
        S.generate_speculative(M.from_preset("tiny", mtp=True), [[1, 2]], draft_tokens=4)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        dataclasses.replace(M.PRESETS["tiny"], num_nextn_predict_layers=2)


@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
@pytest.mark.parametrize("preset", ["tiny", "v3.2-tiny"])
def test_greedy_speculation_gives_plain_greedy_tokens(preset, draft_tokens, monkeypatch, oracle):
    model = M.from_preset(preset, mtp=True, seed=draft_tokens)
    gen = torch.Generator().manual_seed(draft_tokens)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (5, 40, 1)]
    params = SamplingParams(max_tokens=13)
    # V3.2's index keys unquantized: a verify step (the new tokens' keys as computed) and a
    # decode step (as cached) then pick the same tokens to attend to
    options = dict(draft_tokens=draft_tokens, index_dtype=torch.float32)
    want = model.generate(prompts, params, index_dtype=torch.float32)
    # the module's own drafts (random weights: almost all rejected)
    stats = S.SpeculativeStats()
    got = S.generate_speculative(model, prompts, params, stats=stats, **options)
    assert got == want
    assert stats.drafted > 0
    # drafts of the right token but at every fifth position: whole runs accepted, then rolled
    # back after the first wrong one
    positions = {len(p) + i: t for p, w in zip(prompts, want, strict=True) for i, t in enumerate(w)}
    monkeypatch.setattr(S, "propose", oracle(positions, wrong_every=5))
    stats = S.SpeculativeStats()
    got = S.generate_speculative(model, prompts, params, stats=stats, **options)
    assert got == want
    assert 0.3 < stats.acceptance_rate < 1
    assert stats.accepted_length > 1.3


def test_forced_acceptance_accepts_at_the_chosen_rate():
    model = M.from_preset("tiny", mtp=True)
    stats = S.SpeculativeStats()
    params = SamplingParams(max_tokens=60)
    prompts = [[3, 4, 5], [7, 8], [9]]
    S.generate_speculative(
        model, prompts, params, draft_tokens=1, forced_acceptance=0.7, stats=stats
    )
    assert 0.55 < stats.acceptance_rate < 0.85  # ~120 drafts
    assert stats.drafted == stats.rounds


def test_a_batch_accepts_for_each_sequence_what_it_accepts_alone():
    """Greedy and sampled sequences (top-k, top-p) with 0 to 3 drafts in one batch, each with
    rows of its own in the logits: `accept` decides each as it does alone; greedily, the drafts
    up to the first that is not the argmax, then the argmax; forced to keep every draft or
    none, the drafts and then the token `sample` draws after them, or that token at the first."""
    vocab, counts = 40, [0, 1, 2, 3, 3, 2, 1, 3]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=int(torch.randint(1000, ())))
        for t, k, p in [(0, 0, 1), (0.9, 0, 1), (0, 0, 1), (0.7, 5, 1)] * 2
    ]
    params[5] = dataclasses.replace(params[5], top_p=0.8)
    positions = torch.randint(10, 100, (len(counts),)).tolist()
    first_rows = torch.randint(0, 3, (len(counts),)).tolist()  # gaps between sequences' rows
    for i in range(1, len(counts)):
        first_rows[i] += first_rows[i - 1] + counts[i - 1] + 1
    logits = torch.randn(first_rows[-1] + counts[-1] + 1, vocab) * 3
    drafts, probs = [], []
    for p, at, first, n in zip(params, positions, first_rows, counts, strict=True):
        module = logits[first : first + n] + torch.randn(n, vocab)
        tokens, q = S.propose(module, [p] * n, [at + j for j in range(n)])
        proposed = list(zip(tokens.tolist(), q, strict=True))
        best = logits[first : first + n + 1].argmax(-1).tolist()
        right = int(torch.randint(0, n + 1, ()))
        greedy = best[:right] + [(t + 1) % vocab for t in best[right:n]]  # then a wrong one
        drafts.append(greedy if p.greedy else [t for t, _ in proposed])
        probs.append([q for _, q in proposed])
    for forced in (None, 0.0, 1.0):
        got = S.accept(logits, first_rows, drafts, probs, params, positions, forced)
        for i, (first, d) in enumerate(zip(first_rows, drafts, strict=True)):
            alone = S.accept(
                logits[first : first + len(d) + 1], [0], [d], [probs[i]], [params[i]],
                [positions[i]], forced,
            )  # fmt: skip
            assert got[i] == alone[0]
            rows = logits[first : first + len(d) + 1]
            if forced is not None:
                kept = d if forced else []
                after = M.sampling.sample(
                    rows[len(kept) :][:1], [params[i]], [positions[i] + len(kept)]
                )
                assert got[i] == kept + after
            elif params[i].greedy:
                best = rows.argmax(-1).tolist()
                right = next((j for j, t in enumerate(d) if t != best[j]), len(d))
                assert got[i] == [*d[:right], best[right]]


VOCAB = 6
TARGET = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
DRAFT = torch.tensor([0.0, 2.0, -1.0, 1.0, 0.5, -2.0])  # far from the target


def first_tokens(accept, n: int = 6000, temperature: float = 0.8) -> torch.Tensor:
    """Counts of the first token of a round over n seeds: one draft from DRAFT, verified
    against TARGET at the temperature, by `accept`."""
    counts = torch.zeros(VOCAB)
    for seed in range(n):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=4)
        (token,), (q,) = S.propose(DRAFT.unsqueeze(0), [params], [10])
        token = int(token)
        got = accept(torch.stack([TARGET, TARGET]), [0], [[token]], [[q]], [params], [10])
        counts[got[0][0]] += 1
    return counts


def wrong_accept(logits, first_rows, drafts, draft_probs, params, positions):
    """Accept one sequence's one draft by the ratio, but replace a rejected draft from p
    instead of max(0, p - q)."""
    (draft,), (q,), (params,), (position,) = drafts[0], draft_probs[0], params, positions
    p = M.sampling.probabilities(logits[:1], [params])[0]
    u = float(S.uniform(S._keys([params], [position], S.ACCEPT, "cpu"), 1))
    if u * q[draft] < p[draft]:
        return drafts
    return [M.sampling.sample(logits[:1], [params], [position])]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square with 5 degrees of freedom: above 20.5 one time in 1,000, above 35.9 in 10^6
def test_accepted_tokens_follow_the_target_distribution():
    p = (TARGET / 0.8).softmax(-1)
    assert chi_square(first_tokens(S.accept), p) < 20.5
    # the test can fail: the same counts from a wrong replacement rule
    assert chi_square(first_tokens(wrong_accept), p) > 35.9


def test_the_module_loads_from_layer_num_hidden_layers_of_a_checkpoint(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=2)  # transformers writes no MTP weights
    assert M.from_pretrained(tmp_path, dtype=torch.float32).mtp is None
    args = read_config(tmp_path)
    assert args.num_nextn_predict_layers == 1
    source = M.from_args(args, seed=5)
    tensors = {name: t.clone() for name, t, _ in checkpoint_tensors(source)}
    layer = f"model.layers.{args.num_hidden_layers}"
    assert f"{layer}.eh_proj.weight" in tensors
    assert f"{layer}.shared_head.norm.weight" in tensors
    # the checkpoint's copies of the embedding and head, which the module does not read
    tensors[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for file in tmp_path.glob("*.safetensors*"):
        file.unlink()
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = M.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, want), (_, got) in zip(
        source.mtp.state_dict().items(), loaded.mtp.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
