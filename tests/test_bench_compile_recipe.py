"""``recipes/bench_models.py --compile`` on the CPU: its profile summary sorts kernel names into the kinds it reports
(the ELSA kernels, copies, Inductor's fused kernels, SDPA, GEMMs), its options are checked, and the whole flow
(convert, compile each side, interleaved timing, profile, JSON rows) runs with ``--cpu-smoke`` on a one-block
model (AOTAutograd as the compile backend: Inductor's C++ compile would take a minute on two cores)."""

import json

import pytest


@pytest.mark.parametrize("name,kind", [
    ("_elsa_fwd_sm90", "elsa"), ("elsa_merge_rows", "elsa"), ("elsa_surgery::reference_attention", "elsa"),
    ("triton_poi_fused_clone_transpose_0", "copy"), ("cpp_fused__unsafe_view_clone_3", "copy"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copy"), ("Memcpy DtoD", "copy"),
    ("triton_poi_fused_add_clone_mul_2", "inductor"), ("triton_red_fused_native_layer_norm_1", "inductor"),
    ("cpp_fused_gelu_4", "inductor"), ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "sdpa"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "gemm"), ("aten::addmm", "gemm"),
    ("cudaLaunchKernel", "other"),
])
def test_profile_kinds(name, kind, load_recipe):
    assert load_recipe("bench_models").kernel_kind(name) == kind


def test_compile_options_are_checked(load_recipe, capsys):
    m = load_recipe("bench_models")
    for argv, words in ((["--compile", "fast"], "--compile: unknown mode 'fast'"),
                        (["--compile", "default", "--eager"], "--eager, --compile and --train are separate suites"),
                        (["--compile", ","], "--compile: name at least one mode")):
        with pytest.raises(SystemExit):
            m.parse_args(argv)
        assert words in capsys.readouterr().err
    a = m.parse_args(["--compile", "default,reduce-overhead,max-autotune", "--cpu-smoke"])
    assert a.compile_modes == ["default", "reduce-overhead", "max-autotune"]
    assert a.workloads == list(m.SMOKE_WORKLOADS) and a.batches == [1] and (a.rounds, a.calls) == (2, 2)
    with pytest.raises(SystemExit) as exit_:
        m.parse_args(["--help"])
    assert exit_.value.code == 0 and "--compile MODES" in capsys.readouterr().out


def test_compile_smoke_run_writes_rows(tmp_path, load_recipe, capsys):
    m = load_recipe("bench_models")
    out = tmp_path / "rows.json"
    assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads", "deit3_s",
                   "--dtypes", "fp32", "--rounds", "1", "--calls", "1", "--profile", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["records"]
    assert "error" not in row, row.get("traceback")
    assert row["workload"] == "deit3_s" and row["mode"] == "default" and row["converted_modules"] == 1
    assert row["backends_used"] == {"reference": 1} and not row["fallbacks"]
    assert row["rel_err_vs_native"] < 1e-5
    assert row["native_compile_s"] > 0 and row["converted_compile_s"] > 0 and row["ratio"] > 0
    assert "elsa" in row["profile"]["converted"] and "elsa" not in row["profile"]["native"]
    assert "sdpa" in row["profile"]["native"]
    printed = capsys.readouterr().out
    converted_line = next(line for line in printed.splitlines() if line.startswith("  converted: "))
    assert "deit3_s fp32 b1 default: native" in printed and "elsa_surgery::reference_attention" in converted_line


def test_compile_control_run_converts_nothing(tmp_path, load_recipe, capsys):
    """``--control``: the A/A run, both sides the native model (no ELSA op in either profile), marked in the row and
    the printed line; the Inductor warm-up is recorded in the environment."""
    m = load_recipe("bench_models")
    out = tmp_path / "rows.json"
    assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads", "deit3_s",
                   "--dtypes", "fp32", "--rounds", "1", "--calls", "1", "--profile", "--control",
                   "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["records"]
    assert "error" not in row, row.get("traceback")
    assert row["control"] and row["converted_modules"] == 0 and row["rel_err_vs_native"] == 0
    assert "elsa" not in row["profile"]["converted"] and "elsa" not in row["profile"]["native"]
    assert data["env"]["inductor_warmup_s"] > 0
    assert "[A/A control: both sides native]" in capsys.readouterr().out


@pytest.mark.parametrize("control", [False, True])
def test_eager_smoke_and_control_runs(tmp_path, load_recipe, capsys, control):
    """``--eager --cpu-smoke`` (the never-slower suite's flow on one-block models on the CPU) and its ``--control``
    A/A run (session 57: both sides native, nothing converted, marked in the row and the line); ``--control`` outside
    --eager/--compile and a workload the smoke run cannot shrink are refused."""
    m = load_recipe("bench_models")
    out = tmp_path / "rows.json"
    assert m.main(["--eager", "--cpu-smoke", "--workloads", "deit3_s,llama13b_2l_512", "--dtypes", "fp32",
                   "--out", str(out)] + (["--control"] if control else [])) == 0
    rows = json.loads(out.read_text())["records"]
    assert [r["workload"] for r in rows] == ["deit3_s", "llama13b_2l_512"]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["ratio"] > 0 and row["batch"] == 1
        if control:
            assert row["control"] and row["converted_modules"] == 0 and row["rel_err_vs_native"] == 0
            assert not row["backends_used"]
        else:
            assert "control" not in row and row["converted_modules"] >= 1 and row["backends_used"]
    text = capsys.readouterr().out
    assert ("[A/A control: both sides native]" in text) == control
    for argv, words in ((["--control"], "--control is the A/A control"),
                        (["--eager", "--cpu-smoke", "--workloads", "swin_t"], "--eager --cpu-smoke runs")):
        with pytest.raises(SystemExit):
            m.parse_args(argv)
        assert words in capsys.readouterr().err


def test_compile_native_first_compiles_the_native_model_first(tmp_path, load_recipe, monkeypatch):
    """``--native-first``: the native model's compile runs before the converted one's (the order decides which side
    finds the other's kernels in Inductor's caches), and the row says which went first."""
    m = load_recipe("bench_models")
    order, natives = [], []
    real_build, real_compile = m.ab_build, m.compile_first_call

    def build(*a, **kw):
        model, call = real_build(*a, **kw)
        natives.append(model)
        return model, call

    def compile_first_call(model, *a):
        order.append("native" if model is natives[-1] else "converted")
        return real_compile(model, *a)

    monkeypatch.setattr(m, "ab_build", build)
    monkeypatch.setattr(m, "compile_first_call", compile_first_call)
    out = tmp_path / "rows.json"
    for flag, first in ((["--native-first"], "native"), ([], "converted")):
        order.clear()
        assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads",
                       "deit3_s", "--dtypes", "fp32", "--rounds", "1", "--calls", "1", "--out", str(out), *flag]) == 0
        (row,) = json.loads(out.read_text())["records"]
        assert "error" not in row, row.get("traceback")
        assert row["compiled_first"] == first
        assert order == (["native", "converted"] if first == "native" else ["converted", "native"])


def test_isolated_compile_times_each_side_in_processes_of_its_own(tmp_path, load_recipe, monkeypatch, capsys):
    """``--isolated-compile``: each side's first compiled call in child processes with caches of their own (the
    children get the cache variables; both cold processes, then the warm ones on the same caches), each child's
    seconds printed as it ends, and the ratios in the row."""
    m = load_recipe("bench_models")
    runs, real_run = [], m.subprocess.run

    def run(cmd, env=None, **kw):
        runs.append((cmd[cmd.index("--compile-child") + 1].split(",")[0], env["TORCHINDUCTOR_CACHE_DIR"],
                     env["TRITON_CACHE_DIR"]))
        return real_run(cmd, env=env, **kw)

    monkeypatch.setattr(m.subprocess, "run", run)
    out = tmp_path / "rows.json"
    assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads", "deit3_s",
                   "--dtypes", "fp32", "--rounds", "1", "--calls", "1", "--isolated-compile", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["records"]
    assert "error" not in row, row.get("traceback")
    for side in ("native", "converted"):
        for run_ in ("cold", "warm"):
            assert row[f"{side}_compile_{run_}_s"] > 0
    assert row["compile_cold_ratio"] > 0 and row["compile_warm_ratio"] > 0
    for run_ in ("cold", "warm"):  # the converted child's memo of torch's kernel analysis (none traced on a CPU)
        assert set(row[f"ttir_memo_{run_}"]) == {"installed", "hits", "misses", "miss_s", "others"}, row
        assert set(row[f"precompile_{run_}"]) == {"calls", "kernels", "loaded", "compiled_s", "errors", "last_error",
                                                    "not"}
    assert [r[0] for r in runs] == ["native", "converted", "native", "converted"]
    assert runs[0][1:] == runs[2][1:] and runs[1][1:] == runs[3][1:] and runs[0][1] != runs[1][1]
    said = [ln.split(", ")[-1].split(":")[0] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("  isolated compile, deit3_s fp32 b")]
    assert said == ["native cold", "converted cold", "native warm", "converted warm"], said


def test_isolated_only_times_the_children_alone(tmp_path, load_recipe, monkeypatch, capsys):
    """``--isolated-only``: the four compile children and no in-process cell (no model built or timed in this
    process); the row holds the compile times and ratios, no runtime ratio; it needs ``--isolated-compile``."""
    m = load_recipe("bench_models")
    children = []
    monkeypatch.setattr(m, "isolated_compile_times", lambda *a: children.append(a) or dict(
        native_compile_cold_s=2.0, converted_compile_cold_s=2.2, native_compile_warm_s=1.0,
        converted_compile_warm_s=1.1, compile_cold_ratio=1.1, compile_warm_ratio=1.1))
    monkeypatch.setattr(m, "ab_build", lambda *a, **k: pytest.fail("the in-process cell ran"))
    out = tmp_path / "rows.json"
    assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads", "deit3_s",
                   "--dtypes", "fp32", "--isolated-compile", "--isolated-only", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["records"]
    assert len(children) == 1 and row["compile_cold_ratio"] == 1.1 and "ratio" not in row, row
    assert "isolated compile (own process and caches): cold 2.0 s -> 2.2 s (1.10x)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        m.parse_args(["--compile", "default", "--isolated-only"])

def test_processes_alternate_the_side_compiled_first(tmp_path, load_recipe, monkeypatch, capsys):
    """``--processes N``: each cell in N child processes of this script, converted first, then native first, ...;
    the cell's ratio is the geometric mean of theirs, with each order's mean and every process's ratio; a child
    that fails names its process; the option is checked."""
    m = load_recipe("bench_models")
    ratios = iter([0.9, 1.1, 0.8])
    seen = []

    def run(cmd, **kw):
        first = "native" if "--native-first" in cmd else "converted"
        seen.append(first)
        rec = dict(workload=cmd[cmd.index("--workloads") + 1], dtype="fp32", batch=1, mode="default",
                   backend="auto", compile_backend="aot_eager", compile_op="inline", converted_modules=1,
                   backends_used=["reference"], fallbacks=[], compiled_first=first, ratio=next(ratios),
                   native_ms=2.0, converted_ms=2.0, native_compile_s=1.0, converted_compile_s=1.0,
                   compile_time_ratio=1.0, rel_err_vs_native=1e-7, compiled_decisions=["d"])
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"records": [rec]}, f)
        return m.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(m.subprocess, "run", run)
    out = tmp_path / "rows.json"
    assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads", "deit3_s",
                   "--dtypes", "fp32", "--processes", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["records"]
    assert seen == ["converted", "native", "converted"]
    assert row["ratio"] == pytest.approx((0.9 * 1.1 * 0.8) ** (1 / 3))
    assert row["ratio_converted_first"] == pytest.approx((0.9 * 0.8) ** 0.5)
    assert row["ratio_native_first"] == pytest.approx(1.1)
    assert [p["compiled_first"] for p in row["processes"]] == seen and row["compiled_decisions"] == ["d"]
    assert "3 processes, geometric means" in capsys.readouterr().out

    def fail(cmd, **kw):  # its record holds the error
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"records": [dict(workload="deit3_s", error="RuntimeError: boom")]}, f)
        return m.subprocess.CompletedProcess(cmd, 0, "", "")

    def crash(cmd, **kw):  # died before writing its records: its stderr is the reason
        return m.subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nMemoryError: no room")

    for child, words in ((fail, ("process 1 failed", "boom")),
                         (crash, ("process 1 failed (1)", "MemoryError: no room"))):
        monkeypatch.setattr(m.subprocess, "run", child)
        assert m.main(["--compile", "default", "--cpu-smoke", "--compile-backend", "aot_eager", "--workloads",
                       "deit3_s", "--dtypes", "fp32", "--processes", "2", "--out", str(out)]) == 0
        (row,) = json.loads(out.read_text())["records"]
        assert all(w in row["error"] for w in words), row["error"]
    for argv, words in ((["--compile", "default", "--processes", "0"], "--processes must be >= 1"),
                        (["--compile", "default", "--processes", "2", "--profile"], "choose one"),
                        (["--eager", "--processes", "2"], "use it with --compile")):
        with pytest.raises(SystemExit):
            m.parse_args(argv)
        assert words in capsys.readouterr().err
