"""Repeated calls under wrappers (stable_attn/call_cache.py): a call whose tensors another layer wraps or watches
gives what the full path gives, however often its signature repeats.

A functorch transform (``torch.vmap``'s BatchedTensor, ``torch.func.jvp``'s wrappers) and a forward-AD level
(dual tensors) leave the tensors' Python type ``torch.Tensor``, so the type test alone lets them through; the
others (a tensor subclass, FakeTensor, inference mode) are checked here too. Each test runs the same calls with
the cache on and off (``call_cache.ENABLED``), a plain no-gradient call of the same signature first, so a
repeated call that skipped the op would show in the bits, the tangent or the calls the op saw.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensorMode

import stable_attn
from stable_attn import call_cache

# one query against three key blocks of 16 (the decode path), and four queries against two (the training forward)
SHAPES = ((1, 40), (4, 32))


def inputs(nq: int, nk: int, lead: tuple = (), seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, 1, 2, n, 8, generator=g) for n in (nq, nk, nk))


def attend(q, k, v):
    return stable_attn.attention(q, k, v, causal=True, backend="torch", block_n=16)


def both(run):
    """``run()`` with the cache on, then off, each starting with nothing remembered."""
    out = []
    for enabled in (True, False):
        call_cache.ENABLED, saved = enabled, call_cache.ENABLED
        call_cache._calls.clear()
        try:
            out.append(run())
        finally:
            call_cache.ENABLED = saved
    return out


@pytest.mark.parametrize(("nq", "nk"), SHAPES)
def test_repeated_calls_under_vmap_give_the_loops_bits(nq, nk):
    q, k, v = inputs(nq, nk, lead=(3,))

    def run():
        with torch.no_grad():
            attend(q[0], k[0], v[0])  # a plain call of the per-sample signature is remembered
            return [torch.vmap(attend)(q, k, v) for _ in range(3)]

    cached, full = both(run)
    with torch.no_grad():
        loop = torch.stack([attend(q[i], k[i], v[i]) for i in range(3)])
    for i, (a, b) in enumerate(zip(cached, full, strict=True)):
        assert torch.equal(a, b) and torch.equal(a, loop), f"vmap call {i}"


def test_repeated_calls_under_forward_ad_are_refused_every_time():
    """The op has no forward-mode derivative: a dual input is refused (not given a missing tangent), and a
    repeated call does not slip past the refusal through the cache."""
    q, k, v = inputs(1, 40)

    def run():
        with torch.no_grad():
            attend(q, k, v)
            with fwAD.dual_level():
                for _ in range(2):
                    with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
                        attend(fwAD.make_dual(q, torch.ones_like(q)), k, v)
                # in a level, a call with no dual input has nothing to differentiate: served, and equal
                return attend(q, k, v)

    cached, full = both(run)
    assert torch.equal(cached, full)


def test_repeated_calls_under_jvp_are_refused_every_time():
    """Without the refusal jvp returned a zero tangent, silently."""
    q, k, v = inputs(1, 40)

    def run():
        with torch.no_grad():
            attend(q, k, v)
            for _ in range(2):
                with pytest.raises(NotImplementedError, match="torch.func.jvp"):
                    torch.func.jvp(lambda q: attend(q, k, v), (q,), (torch.ones_like(q),))
            with pytest.raises(NotImplementedError, match="forward-mode"):
                torch.func.jacfwd(lambda q: attend(q, k, v))(q)

    both(run)


def test_varlen_refuses_forward_mode():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda q: stable_attn.attention_varlen(q, k, v, cu, cu, 4, 4, backend="torch"), (q,),
                       (torch.ones_like(q),))


def test_patched_sdpa_leaves_forward_mode_to_the_original():
    """patch_sdpa serves only calls attention() accepts: under jvp the original sdpa keeps its tangent."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stable_attn.integrations.sdpa import patch_sdpa

    q, k, v = inputs(4, 32)
    t = torch.randn_like(q)

    def sdpa(q):  # looked up at each call: the patched one inside the patch
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel(SDPBackend.MATH):  # torch's CPU flash kernel has no forward AD either
        want = torch.func.jvp(sdpa, (q,), (t,))
        with patch_sdpa(backend="torch"):
            got = torch.func.jvp(sdpa, (q,), (t,))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].abs().max() > 0


class _Watched(torch.Tensor):
    """A subclass that records which functions it sees (the op among them)."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_repeated_calls_on_a_subclass_reach_its_torch_function():
    q, k, v = inputs(1, 40)
    with torch.no_grad():
        attend(q, k, v)
        for _ in range(2):
            _Watched.seen.clear()
            out = attend(q.as_subclass(_Watched), k, v)
            assert _Watched.seen, "the subclass saw nothing: the call skipped the op"
            assert torch.equal(out.as_subclass(torch.Tensor), attend(q, k, v))
    assert len(call_cache._calls) == 1  # only the plain signature is remembered


def test_fake_tensors_are_never_remembered_nor_served_from_a_plain_call():
    q, k, v = inputs(1, 40)
    with torch.no_grad():
        attend(q, k, v)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            outs = [attend(fq, fk, fv) for _ in range(2)]
    assert all(type(o).__name__ == "FakeTensor" and o.shape == q.shape for o in outs)
    assert len(call_cache._calls) == 1


def test_repeated_calls_in_inference_mode_give_the_full_paths_bits():
    q, k, v = inputs(1, 40)

    def run():
        with torch.no_grad():
            attend(q, k, v)
        with torch.inference_mode():
            return [attend(*inputs(1, 40, seed=s)) for s in range(3)]

    cached, full = both(run)
    assert all(o.is_inference() for o in cached)
    for a, b in zip(cached, full, strict=True):
        assert torch.equal(a, b)
