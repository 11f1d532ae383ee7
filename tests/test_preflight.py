"""`specdp validate config`: every check's paths, the JSON shape, exit codes, --set and schema errors."""
import json

import pytest
from typer.testing import CliRunner

from helpers import REPO, build_tokenizer, make_model_dir, set_config_json, write_config
from specdp_cli import plan as plan_module
from specdp_cli.cli import app

runner = CliRunner()
JSON_KEYS = {"ok", "policy", "dp_sync", "drafter_max_model_len", "no_draft_window", "kv_cache", "weights_per_token",
             "quantization", "layout", "async_scheduling",
             "checks", "errors",
             "warnings", "speculation"}


def validate(cfg_path, *args):
    res = runner.invoke(app, ["validate", "config", str(cfg_path), "--json", *args])
    out = json.loads(res.stdout) if res.stdout.strip().startswith("{") else None
    return res.exit_code, out, res


def check(out, name):
    return next(c for c in out["checks"] if c["name"] == name)


@pytest.fixture
def base(models, tmp_path):
    def make(**over):
        data = {"model": str(models["target"]), "max_model_len": 256,
                "speculative": {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": 3}}
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):
                data[k] = {**data[k], **v}
            else:
                data[k] = v
        return write_config(tmp_path / "c.yaml", data)
    return make


@pytest.fixture(scope="module")
def pr40589(tmp_path_factory, models):
    """vLLM PR #40589: DP 4, max_model_len 4100, k 3, a model drafter whose own limit is 4100."""
    root = tmp_path_factory.mktemp("pr40589")
    target = make_model_dir(root / "target", models["tokenizer"], max_pos=8192, seed=3)
    draft = make_model_dir(root / "draft", models["tokenizer"], max_pos=4100, layers=1, seed=4)
    return root, {"model": str(target), "max_model_len": 4100,
                  "speculative": {"model": str(draft), "num_speculative_tokens": 3},
                  "parallel": {"data_parallel_size": 4, "dp_sync": "always"}}


def test_pr40589_dummy_and_window(pr40589):
    root, data = pr40589
    code, out, _ = validate(write_config(root / "c.yaml", data))
    assert code == 0, out["errors"]
    assert set(out) == JSON_KEYS
    assert out["ok"] is True
    assert out["policy"] == "dummy"
    assert out["dp_sync"] == "always"
    assert out["drafter_max_model_len"] == 4100
    assert out["no_draft_window"] == [4098, 4099]
    assert [c["name"] for c in out["checks"]] == ["files", "lengths", "vocab", "parallel", "policy", "speculation length",
                                                  "memory", "scheduler"]
    assert all(set(c) == {"name", "status", "detail"} for c in out["checks"])


def test_pr40589_explicit_skip_is_refused(pr40589):
    root, data = pr40589
    cfg = write_config(root / "c.yaml", data)
    code, out, _ = validate(cfg, "--set", "speculative.policy=skip")
    assert code == 1
    assert out["ok"] is False and check(out, "policy")["status"] == "error"
    msg = " ".join(out["errors"])
    assert "hang" in msg and "different collective sequences" in msg and "policy: dummy" in msg
    # the human table says the same
    res = runner.invoke(app, ["validate", "config", str(cfg), "--set", "speculative.policy=skip"])
    assert res.exit_code == 1 and "hang" in res.stdout


@pytest.mark.parametrize("override,policy", [
    (["--set", "parallel.data_parallel_size=1"], "skip"),
    (["--dp", "1"], "skip"),
    (["--set", "speculative.method=ngram"], "skip"),
    (["--set", "parallel.dp_sync=never"], "skip"),
    (["--set", "speculative.method=none"], None),
])
def test_pr40589_policy_variants(pr40589, override, policy):
    root, data = pr40589
    code, out, _ = validate(write_config(root / "c.yaml", data), *override)
    assert code == 0, out["errors"]
    assert out["policy"] == policy
    if policy is None:
        assert out["no_draft_window"] is None and out["drafter_max_model_len"] is None


def test_toml_config_and_relative_paths(models, tmp_path):
    import shutil
    shutil.copytree(models["target"], tmp_path / "t")
    shutil.copytree(models["draft"], tmp_path / "d")
    sub = tmp_path / "cfgs"
    sub.mkdir()
    # paths written in a file are relative to the file
    cfg = write_config(sub / "c.toml", {"model": "../t", "max_model_len": 128,
                                        "speculative": {"model": "../d", "num_speculative_tokens": 2}})
    code, out, _ = validate(cfg)
    assert code == 0, out
    assert out["drafter_max_model_len"] == 128 and out["no_draft_window"] == [127, 127]


def test_files_errors(base, tmp_path, models):
    code, out, _ = validate(base(model=str(tmp_path / "nope")))
    assert code == 1 and check(out, "files")["status"] == "error"
    assert "not found" in check(out, "files")["detail"]
    code, out, _ = validate(base(speculative={"model": None}))
    assert code == 1 and "speculative.model" in check(out, "files")["detail"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    code, out, _ = validate(base(tokenizer=str(empty)))
    assert code == 1 and "tokenizer" in check(out, "files")["detail"]
    code, out, _ = validate(base(chat_template=str(tmp_path / "missing.jinja")))
    assert code == 1 and "chat_template" in check(out, "files")["detail"]


def test_lengths_paths(base, models, tmp_path):
    code, out, _ = validate(base())
    assert code == 0 and check(out, "lengths")["status"] == "ok"
    assert out["no_draft_window"] == [254, 255] and "254" in check(out, "lengths")["detail"]
    # M above the target's max_position_embeddings (512): error; with rope scaling: warn
    code, out, _ = validate(base(max_model_len=1024))
    assert code == 1 and check(out, "lengths")["status"] == "error" and "512" in check(out, "lengths")["detail"]
    import shutil
    roped = shutil.copytree(models["target"], tmp_path / "roped")
    set_config_json(roped, rope_scaling={"rope_type": "linear", "factor": 2.0})
    code, out, _ = validate(base(model=str(roped), max_model_len=1024, speculative={"max_model_len": 512}))
    assert code == 0 and check(out, "lengths")["status"] == "warn"
    # the drafter's own limit below M: warn, with the window starting at D - k + 1
    code, out, _ = validate(base(speculative={"max_model_len": 100}))
    assert code == 0 and check(out, "lengths")["status"] == "warn"
    assert out["drafter_max_model_len"] == 100 and out["no_draft_window"] == [98, 255]
    # k + 1 >= M, and a drafter cap above M
    code, out, _ = validate(base(max_model_len=4, speculative={"num_speculative_tokens": 3}))
    assert code == 1 and "below max_model_len" in check(out, "lengths")["detail"]
    code, out, _ = validate(base(speculative={"max_model_len": 300}))
    assert code == 1 and "speculative.max_model_len" in check(out, "lengths")["detail"]


def test_vocab_paths(base, models, tmp_path):
    code, out, _ = validate(base())
    assert check(out, "vocab")["status"] == "ok"
    other_tok = tmp_path / "othertok"
    build_tokenizer(other_tok, vocab_size=300, extra="completely different words here zebra quokka")
    other = make_model_dir(tmp_path / "other", other_tok, layers=1)
    code, out, _ = validate(base(speculative={"model": str(other)}))
    assert code == 1 and check(out, "vocab")["status"] == "error" and "tokenizer" in check(out, "vocab")["detail"]
    padded = make_model_dir(tmp_path / "padded", models["tokenizer"], layers=1, vocab=400)
    code, out, _ = validate(base(speculative={"model": str(padded)}))
    assert code == 0 and check(out, "vocab")["status"] == "warn" and "embedding" in check(out, "vocab")["detail"]


def test_parallel_paths(base, models, tmp_path, monkeypatch):
    code, out, _ = validate(base(parallel={"data_parallel_size": 3, "num_machines": 2, "main_process_port": 29555}))
    assert code == 1 and "multiple of num_machines" in check(out, "parallel")["detail"]
    code, out, _ = validate(base(parallel={"data_parallel_size": 0}))
    assert code == 1 and ">= 1" in check(out, "parallel")["detail"]
    monkeypatch.setattr(plan_module, "cuda_device_count", lambda: 0)
    code, out, _ = validate(base(device="cuda"))
    assert code == 1 and "no GPU" in check(out, "parallel")["detail"]
    monkeypatch.setattr(plan_module, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(plan_module, "device_memory", lambda device: (80 << 30, 80 << 30))
    code, out, _ = validate(base(device="cuda", parallel={"data_parallel_size": 4}))
    assert code == 1 and "4 ranks per machine need 4 GPUs" in check(out, "parallel")["detail"]
    code, out, _ = validate(base(device="cuda", parallel={"data_parallel_size": 2}))
    assert code == 0 and check(out, "parallel")["status"] == "ok"
    assert "backend nccl" in check(out, "parallel")["detail"]
    # dp_sync auto resolves from the model config: mixture of experts -> always; an explicit never warns
    import shutil
    moe = shutil.copytree(models["target"], tmp_path / "moe")
    set_config_json(moe, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8,
                    num_experts_per_tok=2)
    code, out, _ = validate(base(model=str(moe), parallel={"data_parallel_size": 2}))
    assert code == 0 and out["dp_sync"] == "always" and out["policy"] == "dummy"
    code, out, _ = validate(base(model=str(moe), parallel={"data_parallel_size": 2, "dp_sync": "never"}))
    assert code == 0 and out["dp_sync"] == "never" and check(out, "parallel")["status"] == "warn"
    code, out, _ = validate(base(parallel={"data_parallel_size": 2}))
    assert out["dp_sync"] == "never" and out["policy"] == "skip"


def test_memory_paths(base, monkeypatch):
    # CPU: the KV cache holds max_num_seqs full-length sequences (256 tokens = 16 blocks of 16 each)
    code, out, _ = validate(base(scheduler={"max_num_seqs": 8}))
    assert check(out, "memory")["status"] == "ok" and "estimate only" in check(out, "memory")["detail"]
    assert out["kv_cache"] == {"block_size": 16, "num_blocks": 8 * 16, "tokens": 8 * 256, "sequences": 8}
    code, out, _ = validate(base(cache={"num_blocks": 40, "block_size": 8}))
    assert out["kv_cache"] == {"block_size": 8, "num_blocks": 40, "tokens": 320, "sequences": 1}
    assert "preempted" in check(out, "memory")["detail"]
    code, out, _ = validate(base(cache={"num_blocks": 15}))
    assert code == 1 and "not even one" in check(out, "memory")["detail"]
    # GPU: what gpu_memory_utilization leaves after the device's current use, weights and a reserve
    monkeypatch.setattr(plan_module, "cuda_device_count", lambda: 1)
    big = {"max_model_len": 256, "scheduler": {"max_num_seqs": 64}}
    gib = 1 << 30
    monkeypatch.setattr(plan_module, "device_memory", lambda device: (80 * gib, 80 * gib))
    code, out, _ = validate(base(device="cuda", **big))
    assert code == 0 and check(out, "memory")["status"] == "ok" and out["kv_cache"]["sequences"] > 64
    tokens = out["kv_cache"]["tokens"]
    code, out, _ = validate(base(device="cuda", cache={"gpu_memory_utilization": 0.5}, **big))
    assert out["kv_cache"]["tokens"] < tokens * 0.6
    monkeypatch.setattr(plan_module, "device_memory", lambda device: (int(1.01 * gib), 80 * gib))
    code, out, _ = validate(base(device="cuda", cache={"gpu_memory_utilization": 1.0}, **big))
    assert code == 0 and 0 < out["kv_cache"]["sequences"] < 64 and "preempted" in check(out, "memory")["detail"]
    monkeypatch.setattr(plan_module, "device_memory", lambda device: (1000, 80 * gib))
    code, out, _ = validate(base(device="cuda", **big))
    assert code == 1 and check(out, "memory")["status"] == "error" and "not even one" in check(out, "memory")["detail"]


def test_unsupported_architecture_is_refused(base, models, tmp_path):
    import shutil
    odd = shutil.copytree(models["target"], tmp_path / "odd")
    set_config_json(odd, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    code, out, _ = validate(base(model=str(odd)))
    assert code == 1 and "GPT2LMHeadModel is not supported" in check(out, "files")["detail"]
    assert "LlamaForCausalLM" in check(out, "files")["detail"]


def test_scheduler_paths(base):
    code, out, _ = validate(base(scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 100}))
    assert code == 0 and check(out, "scheduler")["status"] == "warn" and out["warnings"]
    code, out, _ = validate(base(scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 100}))
    assert check(out, "scheduler")["status"] == "ok"


def test_schema_errors_in_json(base, tmp_path):
    cases = [
        (["--set", "bogus=1"], "bogus: unknown key"),
        (["--set", "speculative.num_speculative_tokens=0"], "speculative.num_speculative_tokens"),
        (["--set", "max_model_len=lots"], "max_model_len"),
        (["--set", "parallel.dp_sync=sometimes"], "parallel.dp_sync"),
        (["--set", "speculative.bogus=1"], "speculative.bogus: unknown key"),
        (["--set", "server.api_server_count=0"], "server.api_server_count"),
        (["--set", "server.event_loop=trio"], "server.event_loop"),
        (["--set", "server.api_server_count=2", "--set", "parallel.num_machines=2", "--set",
          "parallel.main_process_port=29555", "--set", "parallel.data_parallel_size=2"],
         "server.api_server_count > 1 needs num_machines 1"),
    ]
    cfg = base()
    for args, text in cases:
        code, out, res = validate(cfg, *args)
        assert code == 1, (args, res.stdout)
        assert set(out) == JSON_KEYS and out["ok"] is False
        assert out["checks"][0]["name"] == "schema" and out["checks"][0]["status"] == "error"
        assert any(text in e for e in out["errors"]), (text, out["errors"])
    # without --json: a readable message, no traceback
    res = runner.invoke(app, ["validate", "config", str(cfg), "--set", "speculative.num_speculative_tokens=0"])
    assert res.exit_code == 1 and "Traceback" not in res.output and "greater than or equal to 1" in res.output


def test_serve_refuses_an_event_loop_it_cannot_import(base, monkeypatch):
    """server.event_loop uvloop where uvloop is not installed: a message what to do before anything starts; auto
    falls back to asyncio's loop."""
    from specdp_cli.server import event_loop

    monkeypatch.setattr(event_loop, "installed", lambda: False)
    assert event_loop.resolve("auto") == "asyncio" and event_loop.resolve("uvloop") == "uvloop"
    res = runner.invoke(app, ["serve", str(base()), "--set", "server.event_loop=uvloop"])
    assert res.exit_code == 2 and "pip install uvloop" in res.output and "Traceback" not in res.output


def test_speculation_schedule_is_reported(base):
    code, out, _ = validate(base())
    assert out["speculation"] == {"mode": "fixed", "ranges": None, "k_values": [3]}
    code, out, _ = validate(base(speculative={"num_speculative_tokens_per_batch_size": [[5, 64, 0], [1, 4, 2]]},
                                 parallel={"data_parallel_size": 2, "dp_sync": "always"}))
    assert code == 0, out["errors"]
    assert out["speculation"] == {"mode": "per batch size", "ranges": [[1, 4, 2], [5, 64, 0]], "k_values": [0, 2, 3]}
    detail = check(out, "speculation length")["detail"]
    assert "1-4 running: k 2, 5-64 running: k 0; any other batch size: k 3" in detail and "largest batch" in detail
    code, out, _ = validate(base(speculative={"adaptive": True}))
    assert out["speculation"]["mode"] == "adaptive" and out["speculation"]["k_values"] == [0, 1, 2, 3]
    code, out, _ = validate(base(), "--set", "speculative.num_speculative_tokens_per_batch_size=[[1, 4, 7]]")
    assert code == 1 and any("k must lie in 0..num_speculative_tokens (3)" in e for e in out["errors"])


def test_set_values_are_yaml_scalars(base):
    code, out, _ = validate(base(), "--set", "speculative.num_speculative_tokens=5", "--set", "speculative.max_model_len=null")
    assert code == 0 and out["no_draft_window"] == [252, 255]


def test_usage_errors_exit_2(base, tmp_path):
    cfg = base()
    assert runner.invoke(app, ["validate", "config", str(tmp_path / "nope.yaml")]).exit_code == 2
    assert runner.invoke(app, ["validate", "config", str(cfg), "--set", "no_equals_sign"]).exit_code == 2
    assert runner.invoke(app, ["validate", "config", str(cfg), "--set", "=3"]).exit_code == 2
    assert runner.invoke(app, ["validate", "config", str(cfg), "--no-such-flag"]).exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    code, out, _ = validate(bad)
    assert code == 1 and "cannot parse" in out["errors"][0]


def test_human_table(base):
    res = runner.invoke(app, ["validate", "config", str(base())])
    assert res.exit_code == 0
    for name in ("files", "lengths", "vocab", "parallel", "policy", "memory", "scheduler"):
        assert name in res.stdout
    assert "OK" in res.stdout


@pytest.mark.parametrize("name,extra", [("demo.yaml", []), ("dp2-cpu.yaml", []), ("dp-gpu.yaml", ["--set", "device=cpu"]),
                                        ("serve.yaml", [])])
def test_shipped_configs_validate(name, extra):
    code, out, res = validate(REPO / "configs" / name, *extra)
    assert code == 0, (res.stdout, res.stderr if hasattr(res, "stderr") else "")
    assert out["ok"]


def test_module_entry_point(base):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "specdp_cli", "validate", "config", str(base()), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
