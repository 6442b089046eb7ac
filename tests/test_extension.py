"""The compiled extension is loaded and registered; without it distopt falls back to the reference."""

import subprocess
import sys
import textwrap

from distopt import ops


def test_compiled_cpu_kernels_registered():
    assert ops.HAS_EXTENSION, f"distopt._C failed to import: {ops._IMPORT_ERROR}"
    assert ops.missing_kernels(["CPU"]) == []


def test_fallback_without_extension_warns_once_and_computes():
    """With distopt._C unimportable, distopt imports with one RuntimeWarning and every op runs the
    reference implementation (checked on an Adam step against reference.py directly)."""
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["distopt._C"] = None  # makes `from . import _C` raise ImportError
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
            from distopt import ops, reference
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "reference" in msgs[0], msgs
        assert not ops.HAS_EXTENSION and ops.missing_kernels(["CPU"]) == [f"{op}:CPU" for op in ops.OP_NAMES]
        torch.manual_seed(0)
        p, g, m, v = torch.randn(50), torch.randn(50), torch.randn(50), torch.rand(50)
        p2, m2, v2 = p.clone(), m.clone(), v.clone()
        ops.adam_step_([p], [g], [m], [v], lr=0.1, step=2, weight_decay=0.1)
        lr, steps = torch.tensor(0.1, dtype=torch.float64), [torch.tensor(2.0, dtype=torch.float64)]
        reference.adam_step_([p2], [g], [m2], [v2], [], [], lr, steps, 0.9, 0.999, 1e-8, 0.1, True, False, None, None)
        assert torch.equal(p, p2) and torch.equal(m, m2) and not torch.equal(p, torch.zeros(50))
        total, per = ops.l2norm([g])
        assert torch.allclose(total, g.norm())
        print("fallback ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout
