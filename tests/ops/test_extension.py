"""The compiled extension is loaded and registered; without it distopt falls back to the reference."""

import os
import subprocess
import sys
import textwrap

from distopt import ops


def test_compiled_cpu_kernels_registered():
    assert ops.HAS_EXTENSION, f"distopt._C failed to import: {ops._IMPORT_ERROR}"
    assert ops.missing_kernels(["CPU"]) == []


def test_fallback_without_extension_warns_once_and_computes():
    """With distopt._C unimportable, distopt imports with one RuntimeWarning and every op runs the
    reference implementation (checked on an Adam step against reference.py directly, and FusedAdam's
    steps, with packed moments, against torch's AdamW)."""
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
        from distopt import FusedAdam  # its planned steps pass packed moments (the reference unpacks them)
        ps = [torch.nn.Parameter(torch.randn(n)) for n in (5, 17, 3)]
        qs = [torch.nn.Parameter(x.detach().clone()) for x in ps]
        opt, ref = FusedAdam(ps, lr=0.1), torch.optim.AdamW(qs, lr=0.1)
        for i in range(4):
            for a, b in zip(ps, qs):
                a.grad = torch.randn(a.shape)
                b.grad = a.grad.clone()
            opt.step()
            ref.step()
        flat = opt._plan.calls[0].packed["exp_avg"]  # the reference steps the packed moments
        assert [opt.state[x]["exp_avg"].data_ptr() for x in ps] == [flat[o:].data_ptr() for o in ops.packed_offsets(
            [x.numel() for x in ps])[0]]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ps, qs))
        print("fallback ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout


def package_copy(tmp_path, extension: bytes | None) -> str:
    """A copy of the distopt package without its compiled modules; with ``extension``, a file of those
    bytes where distopt/_C's shared library would be. Returns the folder to put on sys.path."""
    import importlib.machinery
    import shutil
    from pathlib import Path

    import distopt

    src = Path(distopt.__file__).parent
    dst = tmp_path / "pkg" / "distopt"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    if extension is not None:
        (dst / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(extension)
    return str(dst.parent)


def fallback_warning(path: str) -> str:
    """The one RuntimeWarning that importing distopt from ``path`` gives (checked: exactly one)."""
    script = textwrap.dedent(
        """
        import sys, warnings
        # An editable install's finder would find the checkout's _C for the copy's missing one.
        sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith("__editable__")]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
            import distopt
        assert "pkg" in distopt.__file__, distopt.__file__
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and not distopt.ops.HAS_EXTENSION, msgs
        print(msgs[0])
        """
    )
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                            cwd=path)  # not the checkout, whose distopt would come first
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_fallback_warning_says_the_extension_is_missing(tmp_path):
    """Not "cannot import name '_C' from partially initialized module (circular import)": what is
    missing, where it was looked for, and how to rebuild."""
    path = package_copy(tmp_path, None)
    msg = fallback_warning(path)
    assert "compiled extension distopt._C is missing" in msg and str(tmp_path) in msg, msg
    assert "circular" not in msg and "reference ops" in msg
    assert "torch >= 2.11" in msg and "pip install -e ." in msg and "build_ext --inplace" in msg


def test_fallback_warning_gives_the_loaders_reason(tmp_path):
    """A file that is not a loadable library: the warning quotes the dynamic loader's own message."""
    path = package_copy(tmp_path, b"not an ELF file")
    msg = fallback_warning(path)
    assert "compiled extension distopt._C failed to load" in msg, msg
    assert "invalid ELF header" in msg or "file too short" in msg, msg  # dlopen's words
    assert "pip install -e ." in msg
