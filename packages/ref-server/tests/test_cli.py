import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from ref_server import __version__
from ref_server.services.config import OVERLAP_STEPS, PRESET_NAMES, ROLES, TWO_BATCH, ServeConfig

NO_TORCH = ("torch", "grpc", "fastapi", "rich")  # what building the parser must not import


def ref_server(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ref_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def one_error_line(result: subprocess.CompletedProcess, command: str) -> str:
    """The single line a failed command prints: exit code 2, nothing on stdout, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"ref-server {command}: error: "), line
    return line


def without_cuda(secret: str | None = None) -> dict[str, str]:
    """This environment, with no CUDA device visible (also on a GPU machine) and the internal
    secret set or not."""
    env = {k: v for k, v in os.environ.items() if k != "REF_SERVER_INTERNAL_SECRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if secret is not None:
        env["REF_SERVER_INTERNAL_SECRET"] = secret
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_economics_table_shows_the_published_day():
    result = ref_server("economics")
    assert result.returncode == 0, result.stderr
    for figure in ("$87,072", "$562,027", "545%"):
        assert figure in result.stdout


def test_economics_json_layers_preset_file_and_flags(tmp_path):
    config = tmp_path / "rented.toml"
    config.write_text('preset = "deepseek-day6"\ngpu_hour_usd = 3.0\nmean_nodes = 100\n')
    result = ref_server("economics", "--config", str(config), "--mean-nodes", "50", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["preset"] == "deepseek-day6"
    assert document["inputs"]["gpu_hour_usd"] == 3.0  # from the file
    assert document["inputs"]["mean_nodes"] == 50  # the flag wins over the file
    assert document["inputs"]["output_usd_per_m"] == 2.19  # from the preset
    assert document["report"]["cost_usd"] == pytest.approx(3.0 * 8 * 50 * 24)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output-usd-per-m", "-1"], "output_usd_per_m must not be negative"),
        (["--mean-nodes", "0"], "mean_nodes must be greater than zero"),
        (["--cache-hit-tokens", "7e11"], "cache_hit_tokens (7e+11) exceeds input_tokens"),
        (["--preset", "gpt-day1"], "unknown preset 'gpt-day1'"),
        (["--config", "/nonexistent/day.toml"], "config file not found: /nonexistent/day.toml"),
    ],
)
def test_economics_bad_input_exits_with_one_clear_message(args, message):
    result = ref_server("economics", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("ref-server economics: error: ")
    assert message in line


def test_unparseable_number_is_rejected_by_the_parser():
    result = ref_server("economics", "--gpu-hour-usd", "cheap")
    assert result.returncode == 2
    assert "invalid float value: 'cheap'" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- serve and demo: help


def help_text(command: str) -> str:
    """`command --help` on a terminal wide enough that argparse wraps nothing."""
    result = ref_server(command, "--help", env={**os.environ, "COLUMNS": "1000"})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def help_entries(text: str) -> dict[str, str]:
    """Each flag's help entry (the flag line and its continuation lines, joined), by flag."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"  -", line):  # a flag; deeper-indented lines continue its help
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and re.match(r"\s{3,}\S", line):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def shown_default(value) -> str:
    if value in (None, "", []):
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_serve_help_lists_every_setting_with_its_default_the_presets_and_roles():
    text = help_text("serve")
    entries = help_entries(text)
    defaults = ServeConfig()
    for field in dataclasses.fields(ServeConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in entries, f"serve --help has no {flag}"
        assert field.metadata["help"] in entries[flag]
        assert f"(default: {shown_default(getattr(defaults, field.name))})" in entries[flag]
    assert "--no-isolate-cache" in entries["--isolate-cache"]
    assert f"--preset {{{','.join(PRESET_NAMES)}}}" in entries["--preset"]
    assert f"--role {{{','.join(ROLES)}}}" in entries["--role"]
    for title in ("what runs, and where", "model", "engine", "router", "ranks", "security"):
        assert re.search(rf"^{re.escape(title)}.*:$", text, re.M), title
    assert "other settings" not in text  # every field has its group
    assert " TEXT" not in text  # metavars say what goes there
    assert entries["--tls-cert"].startswith("--tls-cert FILE")
    assert entries["--model"].startswith("--model DIR")
    assert entries["--prefill"].startswith("--prefill HOST:PORT,...")
    assert "REF_SERVER_INTERNAL_SECRET" in text  # the epilog says instances need it


def test_demo_help_shows_its_flags_and_defaults_but_not_those_it_sets_itself():
    text = help_text("demo")
    entries = help_entries(text)
    assert "(default: 8)" in entries["--requests"]
    assert "(default: 24)" in entries["--max-tokens"]
    assert "(default: a free port)" in entries["--port"]
    assert "(default: a free port)" in entries["--http-port"]
    assert "(default: warning)" in entries["--log-level"]
    assert f"{{{','.join(PRESET_NAMES)}}}" in entries["--preset"]
    defaults = ServeConfig()
    for name in ("preset", "device", "ranks", "num_blocks", "hold_seconds", "tls_cert"):
        flag = "--" + name.replace("_", "-")
        assert f"(default: {shown_default(getattr(defaults, name))})" in entries[flag]
    for flag in ("--role", "--rank", "--prefill", "--decode", "--group-address"):
        assert flag not in entries  # demo always runs --role all, which sets them
    assert "--role all" in text


def test_building_the_parser_and_help_import_no_torch_grpc_fastapi_or_rich():
    probe = f"""
import contextlib, io, sys
from ref_server.cli import _parser, main
_parser()
for command in ("serve", "demo", "economics"):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([command, "--help"])
print(sorted({{m.split(".")[0] for m in sys.modules}} & set({NO_TORCH!r})))
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # and the command itself, as a user runs it
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ref_server", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m.split(".")[0] in NO_TORCH}


def test_version():
    result = ref_server("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ref-server {__version__}"


def test_top_level_help_lists_the_commands():
    result = ref_server("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "demo", "economics"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command


# ---------------------------------------------------------------- serve and demo: bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["serve", "--hold-seconds", "long"], "argument --hold-seconds: invalid float value"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus (see ref-server serve --help)"),
        (["serve", "--port"], "argument --port: expected one argument"),
        (["serve", "--role", "bogus"], "argument --role: invalid choice: 'bogus'"),
        (["serve", "--preset", "v4"], "argument --preset: invalid choice: 'v4'"),
        (["serve", "--ranks", "0"], "ranks must be > 0, got 0"),
        (["serve", "--port", "70000"], "port must be in 0..65535, got 70000"),
        (["serve", "--http-port", "-1"], "http_port must be in 0..65535, got -1"),
        (["serve", "--tls-cert", "x"], "TLS needs both tls_cert and tls_key"),
        (["serve", "--device", "gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["serve", "--rank", "1"], "need 0 <= rank < ranks, got rank 1 of 1"),
        (["serve", "--role", "prefill", "--ranks", "2"], "needs group_address"),
        (["serve", "--config", "/nonexistent/serve.toml"], "config file not found"),
        (["serve", "--tenant-share", "0"], "tenant_share must be in (0, 1], got 0.0"),
        (
            ["serve", "--max-concurrent-rpcs", "64", "--max-inflight", "64"],
            "max_concurrent_rpcs must be above max_inflight (64), got 64",
        ),
        (["serve", "--max-stops", "0"], "max_stops must be > 0, got 0"),
        (["serve", "--speculative", "eagle"], "argument --speculative: invalid choice: 'eagle'"),
        (["serve", "--speculative", "mtp", "--draft-tokens", "4"], "draft_tokens must be 1 to 3"),
        (["serve", "--draft-tokens", "0"], "draft_tokens must be 1 to 3, got 0"),
        (
            ["serve", "--speculative", "mtp", "--overlap-steps", "on"],
            "speculative mtp does not overlap steps",
        ),
        (["serve", "--elastic"], "elastic needs instances of several ranks (ranks > 1)"),
        (["serve", "--group-store", "external"], "group_store external is for elastic instances"),
        (
            ["serve", "--elastic", "--ranks", "2", "--failure-timeout-s", "0"],
            "failure_timeout_s must be > 0, got 0.0",
        ),
        (
            ["serve", "--role", "decode", "--elastic", "--ranks", "2", "--group-address", "env"],
            "elastic: not under torchrun, which restarts every rank when one dies",
        ),
        (["demo", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["demo", "--requests", "0"], "argument --requests: must be a whole number > 0"),
        (["demo", "--max-tokens", "many"], "argument --max-tokens: must be a whole number"),
        (["demo", "--role", "router"], "unrecognized arguments: --role router"),
        (["demo", "--ranks", "0"], "ranks must be > 0, got 0"),
    ],
)
def test_bad_serve_and_demo_flags_exit_with_one_clear_line(args, message):
    line = one_error_line(ref_server(*args), args[0])
    assert message in line


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        ("bogus_key = 1\n", [], "has unknown keys: bogus_key; known keys: role, host, port"),
        ('port = "x"\n', [], "config file {path}: port must be int, got 'x'"),
        ("isolate_cache = 1\n", [], "config file {path}: isolate_cache must be bool, got 1"),
        ('prefill = "a:1"\n', [], "config file {path}: prefill must be list[str]"),
        ("port = 70000\n", [], "config file {path}: port must be in 0..65535"),
        ('tls_cert = "c.pem"\n', [], "config file {path}: TLS needs both tls_cert and tls_key"),
        ("port = = 1\n", [], "config file {path} is not valid TOML"),
        ('role = "all"\n', ["--ranks", "0"], "error: ranks must be > 0"),  # the flag's fault
    ],
)
def test_bad_serve_config_file_exits_with_one_line_naming_the_file(tmp_path, text, flags, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    line = one_error_line(ref_server("serve", "--config", str(path), *flags), "serve")
    assert message.format(path=path) in line


def test_an_instance_without_the_internal_secret_refuses_at_once():
    # two ranks: the secret is checked before the process waits for its peers
    args = ["--role", "prefill", "--port", "0", "--device", "cpu", "--ranks", "2"]
    args += ["--group-address", f"127.0.0.1:{free_port()}", "--group-timeout-s", "300"]
    line = one_error_line(ref_server("serve", *args, env=without_cuda()), "serve")
    assert "need the deployment's secret" in line
    assert "REF_SERVER_INTERNAL_SECRET" in line
    result = ref_server("serve", "--role", "decode", "--internal-secret-file", "/nonexistent")
    assert "cannot read the internal secret from /nonexistent" in one_error_line(result, "serve")


def test_an_instance_on_cuda_without_cuda_refuses_at_once():
    args = ["--role", "prefill", "--port", "0", "--device", "cuda", "--ranks", "2"]
    args += ["--group-address", f"127.0.0.1:{free_port()}", "--group-timeout-s", "300"]
    result = ref_server("serve", *args, env=without_cuda(secret="s"))
    assert "device cuda: this machine's torch sees no CUDA device" in one_error_line(
        result, "serve"
    )


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_the_deployment_on_cuda_without_cuda_refuses_with_one_line(command):
    result = ref_server(command, "--device", "cuda:0", "--http-port", "0", env=without_cuda())
    line = one_error_line(result, command)  # demo announces nothing either
    assert "device cuda:0: this machine's torch sees no CUDA device" in line


def test_the_demo_streams_clean_text_with_no_log_line_inside_it():
    """Its instances log warnings only, and the random weights' control characters are
    shown as escapes, so the streamed text reaches the terminal whole and harmless."""
    result = ref_server("demo", "--device", "cpu", "--requests", "2", "--max-tokens", "48",
                        env=without_cuda())  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert " INFO " not in result.stdout + result.stderr
    streamed = result.stdout.split(" ->\n", 1)[1].split("\n2 requests in ", 1)[0]
    assert streamed.strip() and all(c.isprintable() for c in streamed.strip("\n"))
    assert "2 requests in " in result.stdout


@pytest.fixture
def signal_handlers():
    """`serve` sets SIGINT and SIGTERM handlers; the test process gets its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_the_deployment_refuses_a_missing_cuda_before_it_starts_a_process(
    monkeypatch, capsys, signal_handlers
):
    import torch

    from ref_server.cli import main

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child process started: {args}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", no_child)
    assert main(["serve", "--role", "all", "--device", "cuda", "--port", "0"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "ref-server serve: error: device cuda: this machine's torch sees no CUDA device"


def test_the_cli_knows_the_model_presets():
    """config.PRESET_NAMES spells the presets without importing torch: it must stay equal to
    the model's."""
    import ref_server.model as M

    assert tuple(M.PRESETS) == PRESET_NAMES


def test_the_limits_come_from_the_config_file_and_flags(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("max_stops = 4\ntenant_share = 0.25\nmax_request_id_length = 32\n")
    config = ServeConfig.from_file(path, max_prompts=8)
    assert (config.max_stops, config.tenant_share, config.max_prompts) == (4, 0.25, 8)
    assert (config.max_request_id_length, config.max_choices) == (32, 64)
    assert ServeConfig().isolate_cache  # per API key unless told otherwise


def test_the_cli_knows_the_two_batch_modes():
    from ref_server.engine.model_runner import TWO_BATCH_MODES

    assert TWO_BATCH_MODES == TWO_BATCH
    with pytest.raises(ValueError, match="two_batch must be one of auto, on, off, got 'yes'"):
        ServeConfig(two_batch="yes")
    with pytest.raises(ValueError, match="two_batch_decode_tokens must be >= 2"):
        ServeConfig(two_batch_decode_tokens=1)


def test_the_cli_knows_the_overlap_steps_modes():
    from ref_server.engine.engine import OVERLAP_STEPS_MODES

    assert OVERLAP_STEPS_MODES == OVERLAP_STEPS


def test_speculative_decoding_is_a_serving_choice_from_the_config_file_and_flags(
    tmp_path, checkpoints
):
    from ref_server.model.speculative import MAX_DRAFT_TOKENS
    from ref_server.services.config import MAX_DRAFT_TOKENS as MAX_IN_CONFIG
    from ref_server.services.servers import load_model, model_args, model_fingerprint

    assert MAX_IN_CONFIG == MAX_DRAFT_TOKENS
    path = tmp_path / "serve.toml"
    path.write_text('speculative = "mtp"\ndraft_tokens = 2\ndevice = "cpu"\n')
    config = ServeConfig.from_file(path)
    assert (config.speculative, config.draft_tokens) == ("mtp", 2)
    assert ServeConfig.from_file(path, draft_tokens=3).draft_tokens == 3
    assert load_model(config, None).mtp is not None  # a preset gets the module with the flag
    assert load_model(ServeConfig(device="cpu"), None).mtp is None
    assert model_fingerprint(config) != model_fingerprint(ServeConfig(device="cpu"))
    checkpoints.write(tmp_path / "no-mtp", seed=1)  # transformers saves no MTP weights
    with pytest.raises(ValueError, match=r"--speculative mtp: .*no-mtp has no MTP module"):
        model_args(config.replace(model=str(tmp_path / "no-mtp")))


def test_fp8_weights_are_a_serving_choice_and_part_of_the_fingerprint():
    import ref_server.model.fp8 as fp8
    from ref_server.services.servers import load_model, model_fingerprint

    with pytest.raises(ValueError, match="weight_dtype must be one of dense, fp8, got 'int4'"):
        ServeConfig(weight_dtype="int4")
    dense, fp8_config = ServeConfig(device="cpu"), ServeConfig(device="cpu", weight_dtype="fp8")
    assert model_fingerprint(dense) != model_fingerprint(fp8_config)
    model = load_model(fp8_config, None)
    assert any(isinstance(m, fp8.FP8Linear) for m in model.modules())
    assert not any(isinstance(m, fp8.FP8Linear) for m in load_model(dense, None).modules())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--expert-placement", "/nonexistent.json"],
            "/nonexistent.json is not an expert placement",
        ),
        (
            ["--redundant-experts", "1", "--ranks", "2"],
            "8 routed experts + 1 redundant do not split",
        ),
        (["--redundant-experts", "-1"], "redundant_experts must be >= 0, got -1"),
        (["--eplb-save", "p.json"], "eplb_save needs eplb_interval > 0"),
        (["--eplb-layers-per-step", "0"], "eplb_layers_per_step must be > 0"),
    ],
)
def test_bad_expert_balancing_settings_exit_with_one_line_before_anything_starts(flags, message):
    args = ["--device", "cpu", "--http-port", "0", *flags]
    assert message in one_error_line(ref_server("serve", *args, env=without_cuda()), "serve")
