"""`import elsa_surgery` needs only torch; kernels/ and adapters/ install inside the package."""

import importlib.metadata
import importlib.util
import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import sys
    import torch  # torch may import triton itself; what matters is what elsa_surgery adds
    LIBS = {'timm', 'transformers', 'open_clip', 'triton', 'accelerate', 'safetensors'}
    before = set(sys.modules)
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in LIBS and name not in sys.modules:
                raise ImportError('blocked for this test: ' + name)
    sys.meta_path.insert(0, Block())
    import elsa_surgery
    q = torch.randn(1, 2, 5, 8)
    out = elsa_surgery.attention(q, q, q)
    print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in LIBS))
""")


def test_import_needs_only_torch():
    res = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_no_top_level_kernels_or_adapters_module():
    import elsa_surgery.adapters
    import elsa_surgery.kernels

    assert elsa_surgery.kernels.__name__ == "elsa_surgery.kernels"
    assert elsa_surgery.adapters.__name__ == "elsa_surgery.adapters"
    owners = importlib.metadata.packages_distributions()
    for name in ("kernels", "adapters"):
        ours = [d for d in owners.get(name, []) if d.lower().replace("_", "-") == "elsa-surgery"]
        assert not ours, f"elsa-surgery installs a top-level {name!r}"
        spec = importlib.util.find_spec(name)
        # run from the repo root, a bare `kernels` could resolve to the source folder; an installed one must be
        # another distribution's (Hugging Face's `kernels`, which transformers >= 5.25 requires)
        if spec is not None and "site-packages" in (spec.origin or str(spec.submodule_search_locations)):
            assert owners.get(name), (name, spec)


CLASH = textwrap.dedent("""
    import importlib, sys, torch
    import elsa_surgery.kernels
    from elsa_surgery.kernels import ops
    first = torch._C._dispatch_dump("elsa_surgery::attention")  # the op's registrations, as the dispatcher has them
    sys.path.insert(0, {root!r})  # a source checkout on sys.path, as `python -m pytest` from the root has
    bare = importlib.import_module("kernels")  # what transformers does to probe Hugging Face's `kernels`
    assert not hasattr(bare, "attention"), "the bare `kernels` import must stay inert"
    assert torch._C._dispatch_dump("elsa_surgery::attention") == first, "custom ops registered twice"
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(1, 2, 5, 8)
        out, lse = ops.attention_op(q, q, q, None, None, None, 0.5, False, "")
    print(tuple(out.shape))
""")


def test_bare_kernels_import_from_a_checkout_is_inert():
    """transformers imports a top-level `kernels` if one is importable; ours must not re-register ops."""
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", CLASH.format(root=root)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "(1, 2, 5, 8)"


HAND_OVER = textwrap.dedent("""
    import importlib.metadata, sys
    sys.path.insert(0, {root!r})  # a source checkout's root on sys.path
    import kernels
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        print("inert", kernels.__file__.startswith({root!r}))
    else:
        from kernels import LayerRepository  # what transformers >= 5.25 imports from Hugging Face's package
        print("theirs", kernels.__file__.startswith({root!r}))
""")


def test_bare_kernels_import_from_a_checkout_is_hugging_faces_where_installed():
    """From a source checkout's root, a bare ``import kernels`` (transformers >= 5.25 imports Hugging Face's
    ``kernels`` on every model) gives the installed distribution's package, not this folder; without that
    distribution, this folder, inert."""
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", HAND_OVER.format(root=root)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    try:
        importlib.metadata.distribution("kernels")
        assert res.stdout.split() == ["theirs", "False"], res.stdout
    except importlib.metadata.PackageNotFoundError:
        assert res.stdout.split() == ["inert", "True"], res.stdout
