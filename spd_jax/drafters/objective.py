"""The distillation objective every drafter trains on (the PSM and EAGLE-3 alike): KL(teacher || drafter),
and an optional hard-label term on the teacher's argmax (the token greedy verification accepts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
