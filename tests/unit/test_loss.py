"""Tests of torchtitan_flux.rl.loss against independent float64 loop references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from torchtitan_flux.rl.loss import group_advantages, grpo_loss, token_logprobs

# ------------------------------------------------------------------------------------------ references


def ref_group_advantages(rewards, group_size, std_normalize=True, eps=1e-4):
    r = [float(x) for x in rewards]
    out, zero = [], 0
    for start in range(0, len(r), group_size):
        g = r[start : start + group_size]
        m = sum(g) / len(g)
        if max(g) == min(g):
            zero += 1
            out += [0.0] * len(g)
            continue
        sd = math.sqrt(sum((x - m) ** 2 for x in g) / len(g))  # population std
        out += [(x - m) / (sd + eps) if std_normalize else x - m for x in g]
    return out, zero


def ref_grpo(
    lp,
    beh,
    adv,
    mask,
    prox=None,
    ref=None,
    sw=None,
    clip_low=0.2,
    clip_high=0.28,
    kl_coef=0.0,
    est="k3",
    norm="token",
    tis_cap=0.0,
    num_tokens=None,
    num_sequences=None,
):
    """Per-token loop on 0-d float64 tensors (autograd through indexing). Returns (loss, metrics dict)."""
    n, t_len = lp.shape
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    tot_tok = 0
    m = dict(clip=0.0, kl=0.0, ratio=0.0, w=0.0, trunc=0.0, bkl=0.0)
    iws = []
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        row, cnt = torch.zeros((), dtype=torch.float64), 0
        for t in range(t_len):
            if not bool(mask[i, t]):
                continue
            cnt += 1
            x = lp[i, t]
            a = float(adv[i])
            if prox is None:
                r = torch.exp(x - float(beh[i, t]))
                w = 1.0
            else:
                r = torch.exp(x - float(prox[i, t]))
                raw = math.exp(float(prox[i, t]) - float(beh[i, t]))
                if tis_cap > 0:
                    w = min(raw, tis_cap)
                    m["trunc"] += float(raw > tis_cap)
                else:
                    w = 1.0
            rv = float(r.detach())
            if rv < lo:
                rc = torch.tensor(lo, dtype=torch.float64)
            elif rv > hi:
                rc = torch.tensor(hi, dtype=torch.float64)
            else:
                rc = r
            s1, s2 = r * a, rc * a
            if float(s2.detach()) < float(s1.detach()):
                s = s2
                m["clip"] += 1
            else:
                s = s1
            tok = -w * s
            if ref is not None:
                d = float(ref[i, t]) - float(x.detach())
                m["kl"] += math.exp(d) - d - 1
            if kl_coef > 0:
                dt = ref[i, t] - x
                k = {"k1": -dt, "k2": 0.5 * dt * dt, "k3": torch.exp(dt) - dt - 1}[est]
                tok = tok + kl_coef * k
            if sw is not None:
                tok = tok * float(sw[i])
            row = row + tok
            m["ratio"] += rv
            m["w"] += w
            cur = float(prox[i, t]) if prox is not None else float(x.detach())
            iw = math.exp(cur - float(beh[i, t]))
            iws.append(iw)
            m["bkl"] += iw - 1 - math.log(iw)
        tot_tok += cnt
        if norm == "token":
            total = total + row
        elif cnt:
            total = total + row / cnt
    if norm == "token":
        loss = total / (num_tokens if num_tokens is not None else max(tot_tok, 1))
    else:
        loss = total / (num_sequences if num_sequences is not None else n)
    k = max(tot_tok, 1)
    metrics = {
        "clip_frac": m["clip"] / k,
        "kl": m["kl"] / k,
        "ratio_mean": m["ratio"] / k,
        "is_weight_mean": m["w"] / k if (prox is not None and tis_cap > 0) else 1.0,
        "is_weight_truncated_frac": m["trunc"] / k,
        "behaviour_kl": m["bkl"] / k,
    }
    if iws:
        mean = sum(iws) / len(iws)
        metrics["iw_var"] = sum((v - mean) ** 2 for v in iws) / len(iws)
        metrics["ess_fraction"] = sum(iws) ** 2 / (len(iws) * sum(v * v for v in iws))
    return loss, metrics


# ------------------------------------------------------------------------------------------ fixtures


def make_batch(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    group_size, n = [(2, 6), (3, 9), (4, 12), (2, 10), (3, 12), (4, 8)][seed % 6]
    t_len = int(torch.randint(5, 10, (1,), generator=g))
    beh = -torch.rand(n, t_len, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = beh + 0.3 * torch.randn(n, t_len, generator=g, dtype=torch.float64)
    prox = beh + 0.5 * torch.randn(n, t_len, generator=g, dtype=torch.float64)
    ref = lp + 0.4 * torch.randn(n, t_len, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t_len, generator=g) < 0.7
    mask[0] = False  # an empty row
    mask[n // 2, :] = False
    mask[1, 0] = True
    # rewards with at least one zero-variance group
    rewards = torch.randint(0, 3, (n,), generator=g).to(torch.float64)
    rewards[:group_size] = 1.0
    adv, zero = group_advantages(rewards, group_size)
    assert zero >= 1
    sw = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    # garbage in padding: must not leak into loss or gradients
    lp = torch.where(mask, lp, torch.full_like(lp, math.nan))
    beh = torch.where(mask, beh, torch.full_like(beh, -math.inf))
    prox = torch.where(mask, prox, torch.full_like(prox, 1e4))
    ref = torch.where(mask, ref, torch.full_like(ref, -math.inf))
    return dict(
        lp=lp.to(dtype), beh=beh.to(dtype), prox=prox.to(dtype), ref=ref.to(dtype), adv=adv.to(dtype),
        mask=mask, sw=sw.to(dtype),
    )


PROX_MODES = ["none", "prox_no_tis", "prox_tis"]
KL_MODES = [(0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.1, "k3")]


def run_both(b, norm, prox_mode, kl, use_sw):
    kl_coef, est = kl
    kw = dict(
        proximal_logprobs=None if prox_mode == "none" else b["prox"],
        ref_logprobs=b["ref"] if kl_coef > 0 or prox_mode == "prox_tis" else None,
        sample_weights=b["sw"] if use_sw else None,
        kl_coef=kl_coef,
        kl_estimator=est,
        normalization=norm,
        tis_cap=1.2 if prox_mode == "prox_tis" else 0.0,
    )
    lp = b["lp"].clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, b["beh"], b["adv"], b["mask"], **kw)
    (grad,) = torch.autograd.grad(loss, lp)

    lp64 = b["lp"].to(torch.float64).clone().requires_grad_(True)
    f64 = lambda x: None if x is None else x.to(torch.float64)  # noqa: E731
    ref_loss, ref_metrics = ref_grpo(
        lp64, f64(b["beh"]), f64(b["adv"]), b["mask"], prox=f64(kw["proximal_logprobs"]),
        ref=f64(kw["ref_logprobs"]), sw=f64(kw["sample_weights"]), kl_coef=kl_coef, est=est, norm=norm,
        tis_cap=kw["tis_cap"],
    )
    (ref_grad,) = torch.autograd.grad(ref_loss, lp64, allow_unused=True)
    if ref_grad is None:
        ref_grad = torch.zeros_like(lp64)
    return loss, metrics, grad, ref_loss, ref_metrics, ref_grad


# ------------------------------------------------------------------------------------------ grpo_loss


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("prox_mode", PROX_MODES)
@pytest.mark.parametrize("kl", KL_MODES, ids=lambda k: f"kl{k[0]}-{k[1]}")
def test_grpo_loss_matches_reference_float64(norm, prox_mode, kl):
    for seed in range(3):
        use_sw = seed % 2 == 1
        b = make_batch(seed + 10 * KL_MODES.index(kl))
        loss, metrics, grad, ref_loss, ref_metrics, ref_grad = run_both(b, norm, prox_mode, kl, use_sw)
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-10, rtol=0)
        torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=0)
        assert torch.isfinite(grad).all()
        assert (grad[~b["mask"]] == 0).all()
        for key, val in ref_metrics.items():
            assert metrics[key].requires_grad is False
            assert metrics[key].item() == pytest.approx(val, abs=1e-10), key
        if prox_mode == "prox_tis":
            assert metrics["is_weight_truncated_frac"].item() > 0  # truncation is active in this setup


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_grpo_loss_matches_reference_float32(norm):
    for seed, (prox_mode, kl) in enumerate(itertools.product(PROX_MODES, KL_MODES)):
        b = make_batch(100 + seed, dtype=torch.float32)
        loss, metrics, grad, ref_loss, ref_metrics, ref_grad = run_both(b, norm, prox_mode, kl, seed % 2 == 0)
        assert loss.dtype == torch.float32
        assert abs(loss.item() - ref_loss.item()) < 1e-5
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=0)
        for key, val in ref_metrics.items():
            assert metrics[key].item() == pytest.approx(val, abs=1e-5), key


def test_reference_setup_exercises_clipping():
    b = make_batch(0)
    _, metrics, *_ = run_both(b, "token", "none", (0.0, "k3"), False)
    assert 0 < metrics["clip_frac"].item() < 1


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_global_counts_make_microbatch_losses_sum_to_full_batch(norm):
    b = make_batch(3)
    n = b["lp"].shape[0]
    kw = dict(ref_logprobs=b["ref"], kl_coef=0.05, normalization=norm, proximal_logprobs=b["prox"], tis_cap=1.5)
    full, _ = grpo_loss(b["lp"], b["beh"], b["adv"], b["mask"], **kw)
    count = dict(num_tokens=b["mask"].sum()) if norm == "token" else dict(num_sequences=n)
    parts = 0.0
    for rows in (slice(0, n // 3), slice(n // 3, n)):
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        part, _ = grpo_loss(b["lp"][rows], b["beh"][rows], b["adv"][rows], b["mask"][rows], **sub, **count)
        parts = parts + part
    torch.testing.assert_close(parts, full, atol=1e-12, rtol=0)


def test_clipping_zeroes_gradient_and_is_counted():
    # row 0: A = +1; row 1: A = -1. Ratios chosen per token (behaviour = 0 -> ratio = exp(lp)).
    ratios = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.5, 0.9]], dtype=torch.float64)
    lp = ratios.log().requires_grad_(True)
    beh = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    loss, metrics = grpo_loss(lp, beh, adv, mask, clip_low=0.2, clip_high=0.28)
    (grad,) = torch.autograd.grad(loss, lp)
    # A>0, ratio > 1+clip_high -> clipped; A<0, ratio < 1-clip_low -> clipped: exactly zero gradient
    assert grad[0, 0].item() == 0.0
    assert grad[1, 0].item() == 0.0
    # unclipped tokens keep gradient d(-ratio*A)/dlp / 6 = -ratio*A/6
    expected = torch.tensor([[0.0, -1.1, -0.5], [0.0, 1.5, 0.9]], dtype=torch.float64) / 6
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 6)
    torch.testing.assert_close(loss, torch.tensor((-1.28 - 1.1 - 0.5 + 0.8 + 1.5 + 0.9) / 6, dtype=torch.float64))


def test_zero_advantage_gives_zero_policy_gradient_and_no_clip_count():
    lp = torch.tensor([[1.0, -1.0]], dtype=torch.float64).requires_grad_(True)
    loss, metrics = grpo_loss(lp, torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2))
    (grad,) = torch.autograd.grad(loss, lp)
    assert (grad == 0).all() and loss.item() == 0.0
    assert metrics["clip_frac"].item() == 0.0


def test_staleness_metrics_on_policy():
    b = make_batch(5, dtype=torch.float32)
    _, m = grpo_loss(b["lp"], b["lp"].clone(), b["adv"], b["mask"])
    assert m["ess_fraction"].item() == pytest.approx(1.0, abs=1e-7)
    assert m["iw_var"].item() == 0.0
    assert abs(m["behaviour_kl"].item()) < 1e-7
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    # with a proximal policy equal to behaviour, staleness is measured on proximal, not on logprobs
    _, m = grpo_loss(b["lp"], b["beh"], b["adv"], b["mask"], proximal_logprobs=b["beh"].clone(), tis_cap=2.0)
    assert m["ess_fraction"].item() == pytest.approx(1.0, abs=1e-7)
    assert m["iw_var"].item() == 0.0 and abs(m["behaviour_kl"].item()) < 1e-7
    assert m["is_weight_mean"].item() == pytest.approx(1.0) and m["is_weight_truncated_frac"].item() == 0.0
    # off-policy: all three move
    _, m = grpo_loss(b["lp"], b["beh"], b["adv"], b["mask"], proximal_logprobs=b["prox"], tis_cap=2.0)
    assert m["ess_fraction"].item() < 0.99 and m["iw_var"].item() > 1e-3 and m["behaviour_kl"].item() > 1e-3


def test_empty_batch_is_finite():
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for norm in ("token", "sequence"):
        loss, m = grpo_loss(lp, torch.zeros(3, 4, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                            torch.zeros(3, 4), normalization=norm, ref_logprobs=lp.detach(), kl_coef=0.1)
        (grad,) = torch.autograd.grad(loss, lp)
        assert loss.item() == 0.0 and (grad == 0).all()
        assert all(torch.isfinite(v) for v in m.values())
        assert m["ess_fraction"].item() == 1.0


def test_validation_errors():
    lp = torch.zeros(2, 3)
    beh, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        grpo_loss(lp, beh, adv, mask, kl_estimator="k4")
    with pytest.raises(ValueError, match="token.*sequence"):
        grpo_loss(lp, beh, adv, mask, normalization="batch")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, beh, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        grpo_loss(lp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, beh, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(lp, beh, adv, torch.ones(3, 2))
    with pytest.raises(ValueError, match="proximal_logprobs"):
        grpo_loss(lp, beh, adv, mask, proximal_logprobs=torch.zeros(2))
    with pytest.raises(ValueError, match="sample_weights"):
        grpo_loss(lp, beh, adv, mask, sample_weights=torch.ones(2, 1))
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(lp, beh, adv, mask, num_tokens=0)


# ------------------------------------------------------------------------------------------ advantages


def test_group_advantages_matches_reference():
    g = torch.Generator().manual_seed(0)
    for group_size, std_normalize in itertools.product([1, 2, 3, 4, 7], [True, False]):
        rewards = torch.randint(0, 4, (group_size * 6,), generator=g).double() * 0.5
        rewards[:group_size] = 0.7  # zero-variance group; for G = 3, 7 its float mean is not exactly 0.7
        adv, zero = group_advantages(rewards, group_size, std_normalize=std_normalize)
        ref, ref_zero = ref_group_advantages(rewards.tolist(), group_size, std_normalize)
        torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=0)
        assert zero == ref_zero >= 1
        assert (adv[:group_size] == 0).all()
        assert adv.dtype == torch.float64


def test_group_advantages_zero_variance_exact_and_population_std():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3, 1.0], dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(rewards, 3)
    adv, zero = group_advantages(rewards[:9], 3)
    assert zero == 2
    assert (adv[:3] == 0).all() and (adv[6:] == 0).all() and adv.dtype == torch.float32
    # group [0, 1, 0]: mean 1/3, population std sqrt(2)/3
    sd = math.sqrt(2) / 3
    torch.testing.assert_close(adv[3:6], torch.tensor([-1 / 3, 2 / 3, -1 / 3]) / (sd + 1e-4))
    # float64 mean of three 0.1 is 0.10000000000000002: the residue must not leak into the advantage
    adv64, zero64 = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.2, 0.2, 0.2], dtype=torch.float64), 3)
    assert zero64 == 2 and adv64.eq(0).all()
    adv_i, _ = group_advantages(torch.tensor([0, 1, 1, 1]), 2)
    assert adv_i.dtype == torch.float32 and adv_i[2:].eq(0).all()


# ------------------------------------------------------------------------------------------ token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_matches_log_softmax(temperature, dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    out = token_logprobs(logits, targets, temperature)
    ref = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # float32: the two formulas round differently (a couple of ulp at |logprob| ~ 8 is ~1e-6)
    rtol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=rtol)
    w = torch.randn(3, 5, generator=g).to(dtype)
    (ga,) = torch.autograd.grad((out * w).sum(), logits)
    (gb,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(ga, gb, atol=1e-6, rtol=0)


def test_token_logprobs_bfloat16_upcasts():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 4, 50, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 4), generator=g)
    out = token_logprobs(logits, targets, 0.9)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.detach().float() / 0.9, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.detach(), ref, atol=1e-6, rtol=0)
    out.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, 0.0)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(logits, targets[:, :3])


def test_the_staleness_sample_is_made_of_the_figures_the_step_logs():
    """``BatchGradient.reduce``: the controller's ``StalenessSample`` holds exactly the token means the metrics row
    logs (the same floats), and the version gaps of the batch, unclamped."""
    from torchtitan_flux.rl.controller import StalenessSample
    from torchtitan_flux.rl.gradient import BatchGradient

    sums = {k: torch.tensor(v) for k, v in (("behaviour_kl", 0.3), ("iw_var", 0.7), ("ess_fraction", 2.9), ("kl", 0.1))}
    grad = BatchGradient(torch.tensor(2.5), sums, torch.tensor(3), 0, torch.tensor([-1.0, 1.0, 3.0]))
    reduced = grad.reduce(world=1)
    assert reduced.loss == 2.5 and reduced.means["iw_var"] == (torch.tensor(0.7) / 3).item()
    m = reduced.means
    assert reduced.staleness == StalenessSample(behaviour_kl=m["behaviour_kl"], iw_var=m["iw_var"],
                                                ess_fraction=m["ess_fraction"], version_gap_mean=1.0,
                                                version_gap_max=3.0)
