"""The distillation objective every drafter trains on (the PSM, PPSD and EAGLE-3 alike): KL(teacher || drafter),
and an optional hard-label term on the teacher's argmax (the token greedy verification accepts); `distill_queries`
applies both to a staged drafter's drafts at its query positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spd_jax.models import decoder


def distill_kl(student: jax.Array, teacher: jax.Array, tau: float = 1.0) -> jax.Array:
    """student, teacher [..., V] logits -> [...] float32 KL(softmax(teacher/tau) || softmax(student/tau))
    * tau^2 (the tau^2 keeps the gradient's scale independent of tau). The caller stops the teacher's
    gradient; a draft vocabulary's caller passes the teacher's logits restricted to it (renormalised here)."""
    logp = jax.nn.log_softmax(teacher.astype(jnp.float32) / tau)
    logq = jax.nn.log_softmax(student.astype(jnp.float32) / tau)
    return jnp.sum(jnp.exp(logp) * (logp - logq), -1) * tau ** 2


def top1_ce(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """student, teacher [..., V] logits -> [...] float32 cross-entropy of the student on the teacher's
    argmax: greedy verification accepts a draft only when it is that token, whatever the rest of the
    distribution, so this term spends the drafter's capacity on the top of it. The caller stops the
    teacher's gradient."""
    logq = jax.nn.log_softmax(student.astype(jnp.float32))
    return -jnp.take_along_axis(logq, jnp.argmax(teacher, -1)[..., None], axis=-1)[..., 0]


def distill_queries(student: jax.Array, x_q: jax.Array, w: jax.Array, target: dict, cfg, ids: jax.Array | None = None,
                    top: jax.Array | None = None, tau: float = 1.0, hard_weight: float = 0.0):
    """A drafter's draft logits against the frozen target's at its query positions -> (loss sum, KL sum, agree
    [B, Q] float32: the draft's argmax is the unrestricted teacher's, what greedy verification accepts).

    student [B, Q, V'] the drafter head's logits; x_q [B, Q, H] the target's last hidden state there (its
    gradient stopped); w [B, Q] float32 the positions' weights; ids [V'] a draft vocabulary's token ids (None:
    the whole vocabulary); top [B, Q] the teacher's greedy token when known (the teacher cache's): with a
    draft vocabulary the teacher's logits are then computed over the V' rows only. The loss: the KL at tau
    (restricted to the draft vocabulary, renormalised), plus hard_weight x the cross-entropy on the teacher's
    argmax where that token is in the draft vocabulary (elsewhere verification accepts no draft)."""
    drafted = jnp.argmax(student, -1)
    if ids is not None and top is not None:  # V' of V rows: the head is most of a step
        teacher_v = decoder.head_logits(x_q, target["final_norm"], decoder.lm_head(target, cfg)[ids], cfg)
    else:
        teacher = decoder.lm_logits(target, x_q, cfg)  # [B, Q, V]
        top = jnp.argmax(teacher, -1)
        teacher_v = teacher if ids is None else teacher[..., ids]
    if ids is not None:
        drafted = ids[drafted]
    kl_sum = (distill_kl(student, teacher_v, tau) * w).sum()
    loss = kl_sum
    if hard_weight:
        hit = w if ids is None else w * (ids[jnp.argmax(teacher_v, -1)] == top)
        loss = kl_sum + hard_weight * (top1_ce(student, teacher_v) * hit).sum()
    return loss, kl_sum, (top == drafted).astype(jnp.float32)
