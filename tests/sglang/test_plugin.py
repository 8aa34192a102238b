"""The plugin: SGLang's own argument parsing accepts ``--hicache-storage-backend kvtier``.

Hooks patch SGLang's modules for the rest of a process, so every test that applies them runs
in a fresh Python process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts  # noqa: E402
from test_backend_v1 import attention_model  # noqa: E402
from kvtier.adapters.sglang import plugin  # noqa: E402
from kvtier.adapters.sglang.backend import KvtierHiCacheStorage  # noqa: E402
from kvtier.adapters.sglang.namespace import recorded_kv_format  # noqa: E402

BASE = ["--model-path", "org/model", "--enable-hierarchical-cache"]


def run_python(code: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def parsed(out: subprocess.CompletedProcess) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


def extra_of(argv: list[str]) -> dict:
    return json.loads(argv[argv.index(plugin.EXTRA_FLAG) + 1])


def test_sglang_parses_kvtier_through_the_hook(tmp_path):
    """register() + SGLang's HookRegistry.apply_hooks(), then SGLang's prepare_server_args."""
    out = run_python(f"""
        import json
        from kvtier.adapters.sglang.plugin import register
        from sglang.srt.plugins.hook_registry import HookRegistry
        register()
        HookRegistry.apply_hooks()
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args({BASE!r} + ["--hicache-storage-backend", "kvtier",
            "--hicache-storage-backend-extra-config", '{{"path": "{tmp_path}", "capacity_gb": 2}}'])
        print(json.dumps([args.hicache_storage_backend, args.hicache_storage_backend_extra_config]))
    """)
    backend_name, extra = parsed(out)
    assert backend_name == "dynamic"
    assert json.loads(extra) == {
        "path": str(tmp_path), "capacity_gb": 2, "backend_name": "kvtier",
        "module_path": "kvtier.adapters.sglang.backend", "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
    }


def test_without_the_hook_sglang_refuses_kvtier():
    """The control: SGLang's choices are a closed list."""
    code = f"""
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args({BASE!r} + ["--hicache-storage-backend", "kvtier"])
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "invalid choice: 'kvtier'" in out.stderr


def test_entry_point_is_loaded_by_sglang_load_plugins(tmp_path):
    """SGLang's own load_plugins() finds kvtier's entry point and applies its hook."""
    out = run_python(f"""
        import json
        from importlib.metadata import entry_points
        names = [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvtier"]
        assert names == ["kvtier.adapters.sglang.plugin:register"], (
            "kvtier's pyproject.toml must declare [project.entry-points.'sglang.srt.plugins'] "
            "kvtier = 'kvtier.adapters.sglang.plugin:register'; installed: " + repr(names))
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args({BASE!r} + ["--hicache-storage-backend=kvtier",
            '--hicache-storage-backend-extra-config={{"path": "{tmp_path}"}}'])
        print(json.dumps([args.hicache_storage_backend, args.hicache_storage_backend_extra_config]))
    """)
    backend_name, extra = parsed(out)
    assert backend_name == "dynamic" and json.loads(extra)["module_path"] == "kvtier.adapters.sglang.backend"


def test_factory_builds_the_backend_from_both_routes(tmp_path, gen):
    """The plugin route's rewritten extra config and the plugin-free ``dynamic`` one give the same
    backend through SGLang's factory, sharing pages."""
    argv = plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier",
                                       plugin.EXTRA_FLAG, json.dumps({"path": str(tmp_path)})])
    from sglang_pools import storage_config

    via_plugin = storage_config(tmp_path)
    via_plugin.extra_config = extra_of(argv)
    plain = storage_config(tmp_path)
    assert plain.extra_config == via_plugin.extra_config
    pool = make_host_pool()
    first = make_backend(via_plugin, pool)
    second = make_backend(plain, pool)
    assert isinstance(first, KvtierHiCacheStorage) and isinstance(second, KvtierHiCacheStorage)
    idx, dst = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("routes", 2)
    assert first.batch_set_v1(keys, idx) == [True, True]
    assert second.batch_get_v1(keys, dst) == [True, True]
    assert [page_bytes(pool, d) for d in page_starts(dst)] == [page_bytes(pool, s) for s in page_starts(idx)]
    first.close()
    second.close()


def test_rewrite_leaves_other_backends_alone():
    argv = BASE + ["--hicache-storage-backend", "file"]
    assert plugin.rewrite_argv(argv) is None
    assert plugin.rewrite_argv(BASE) is None
    later_wins = BASE + ["--hicache-storage-backend", "kvtier", "--hicache-storage-backend", "nixl"]
    assert plugin.rewrite_argv(later_wins) is None


def test_rewrite_forms(tmp_path):
    extra = json.dumps({"path": str(tmp_path)})
    spaced = plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, extra])
    assert spaced[spaced.index("--hicache-storage-backend") + 1] == "dynamic"
    joined = plugin.rewrite_argv(BASE + ["--hicache-storage-backend=kvtier", f"{plugin.EXTRA_FLAG}={extra}"])
    assert "--hicache-storage-backend=dynamic" in joined
    assert json.loads(next(t for t in joined if t.startswith(plugin.EXTRA_FLAG + "=")).split("=", 1)[1])[
        "class_name"
    ] == "KvtierHiCacheStorage"
    last = plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "file", "--hicache-storage-backend", "kvtier",
                                       plugin.EXTRA_FLAG, "{}", plugin.EXTRA_FLAG, extra])
    values = [last[i + 1] for i, t in enumerate(last) if t == "--hicache-storage-backend"]
    extras = [last[i + 1] for i, t in enumerate(last) if t == plugin.EXTRA_FLAG]
    assert values == ["file", "dynamic"], "argparse keeps the last occurrence; only that one changes"
    assert extras[0] == "{}" and json.loads(extras[1])["path"] == str(tmp_path)


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_rewrite_reads_an_at_file(tmp_path, suffix):
    path = tmp_path / f"extra{suffix}"
    store = tmp_path / "store"
    if suffix == ".toml":
        path.write_text(f'path = "{store}"\ncapacity_gb = 1.5\n')
    elif suffix == ".yaml":
        path.write_text(f"path: {store}\ncapacity_gb: 1.5\n")
    else:
        path.write_text(json.dumps({"path": str(store), "capacity_gb": 1.5}))
    argv = plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, f"@{path}"])
    assert extra_of(argv)["path"] == str(store) and extra_of(argv)["capacity_gb"] == 1.5


def test_rewrite_expands_a_config_file(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model-path: org/model\nhicache-storage-backend: kvtier\n"
        f"hicache-storage-backend-extra-config:\n  path: {tmp_path}\n"
    )
    argv = plugin.rewrite_argv(["--config", str(config)])
    assert "--config" not in argv
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    assert extra_of(argv)["path"] == str(tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"path": "/x", "capcity_gb": 1}, "unknown key 'capcity_gb'"),
        ({}, "needs \"remote\""),
        ({"path": "/x", "remote": "/y"}, "'path'='/x' and 'remote'='/y' disagree"),
        ({"remote": "/x", "remote_capacity_byte": "1GiB"}, "did you mean 'remote_capacity_bytes'"),
        ({"remote": "/x", "remote_capacity_bytes": "lots"}, "remote_capacity_bytes"),
        ({"remote": "/x", "config": "/nonexistent/kvtier.toml"}, "does not exist"),
        ({"remote": "/x", "remote_timeout_s": 0}, "remote_timeout_s"),
        ({"path": "/x", "module_path": "other.module"}, "sets 'module_path'='other.module'"),
        ({"path": "/x", "interface_v1": 0}, "sets 'interface_v1'=0"),
        ({"path": "/x", "timeout_s": "10"}, "timeout_s"),
        ({"path": "/x", "nixl_backend_params": {"use_uring": True}}, "nixl_backend_params"),
    ],
)
def test_rewrite_refuses_bad_extra_config(extra, message):
    with pytest.raises(ValueError, match=message):
        plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, json.dumps(extra)])


def test_rewrite_refuses_unparseable_extra_config():
    with pytest.raises(ValueError, match="not valid JSON"):
        plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, "{path: /x}"])
    with pytest.raises(ValueError, match="JSON object"):
        plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, "[1]"])


def test_recorder_hook_only_in_scheduler_processes():
    """With SGLang's scheduler module imported, register() wraps ModelRunner's
    configure_kv_cache_dtype; without it, the model runner is not even imported."""
    out = run_python("""
        import json, sys
        import sglang.srt.managers.scheduler
        from kvtier.adapters.sglang.plugin import register
        from sglang.srt.plugins.hook_registry import HookRegistry
        register()
        HookRegistry.apply_hooks()
        from sglang.srt.model_executor.model_runner import ModelRunner
        print(json.dumps(hasattr(ModelRunner.configure_kv_cache_dtype, "__wrapped__")))
    """)
    assert parsed(out) is True
    out = run_python("""
        import json, sys
        from kvtier.adapters.sglang.plugin import register
        from sglang.srt.plugins.hook_registry import HookRegistry
        register()
        HookRegistry.apply_hooks()
        print(json.dumps("sglang.srt.model_executor.model_runner" in sys.modules))
    """)
    assert parsed(out) is False


def kvtier_server_args(tmp="/tmp/kv"):
    """SGLang's own ServerArgs after the plugin's rewrite of ``--hicache-storage-backend kvtier``."""
    from sglang.srt.server_args import ServerArgs

    argv = plugin.rewrite_argv(BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG,
                                       json.dumps({"remote": tmp})])
    return ServerArgs(model_path="org/model", enable_hierarchical_cache=True, hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=argv[argv.index(plugin.EXTRA_FLAG) + 1])


class _Runner:
    """What the recorder reads of SGLang's ModelRunner after configure_kv_cache_dtype."""

    def __init__(self, model, kv_cache_dtype, is_draft_worker, server_args=None):
        self.model, self.kv_cache_dtype, self.is_draft_worker = model, kv_cache_dtype, is_draft_worker
        self.server_args = kvtier_server_args() if server_args is None else server_args


def test_selects_kvtier_reads_sglang_server_args(tmp_path):
    from sglang.srt.server_args import ServerArgs

    assert plugin.selects_kvtier(kvtier_server_args(str(tmp_path)))
    by_hand = {"backend_name": "kvtier", "module_path": "kvtier.adapters.sglang.backend",
               "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "remote": str(tmp_path)}
    at_file = tmp_path / "extra.json"
    at_file.write_text(json.dumps(by_hand))
    for extra in (json.dumps(by_hand), f"@{at_file}"):
        args = ServerArgs(model_path="m", hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=extra)
        assert plugin.selects_kvtier(args)
    other = {**by_hand, "module_path": "my.backend"}
    for backend, extra in (("file", None), ("nixl", None), (None, None), ("dynamic", json.dumps(other))):
        args = ServerArgs(model_path="m", hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra)
        assert not plugin.selects_kvtier(args), backend


def test_recorder_is_silent_when_another_backend_serves(caplog):
    """A server with SGLang's own storage backend gets no record and no kvtier log line."""
    from sglang.srt.server_args import ServerArgs

    caplog.set_level("DEBUG")
    before = recorded_kv_format("target")
    model = attention_model(2, (0.5, 2.0), (1.0, 4.0))
    for backend in ("file", None):
        args = ServerArgs(model_path="m", hicache_storage_backend=backend)
        assert plugin._record_after_configure(None, _Runner(model, torch.float8_e4m3fn, False, args)) is None
    assert recorded_kv_format("target") == before
    assert "kvtier" not in caplog.text


def test_recorder_records_target_and_draft():
    model = attention_model(2, (0.5, 2.0), (1.0, 4.0))
    assert plugin._record_after_configure(None, _Runner(model, torch.float8_e5m2, False)) is None
    assert plugin._record_after_configure(None, _Runner(torch.nn.Module(), torch.bfloat16, True)) is None
    target, draft = recorded_kv_format("target"), recorded_kv_format("draft")
    assert target.kv_dtype == "torch.float8_e5m2" and target.attention_layers == 2 and target.scales
    assert draft.kv_dtype == "torch.bfloat16" and draft.scales is None


def test_recorder_never_fails_the_model_runner(caplog):
    before = recorded_kv_format("target")
    assert plugin._record_after_configure(None, _Runner(model=None, kv_cache_dtype=torch.bfloat16, is_draft_worker=False)) is None
    assert recorded_kv_format("target") == before
    assert "could not record the target model runner's KV format" in caplog.text


def test_hook_passes_argv_given_by_keyword(tmp_path):
    extra = json.dumps({"path": str(tmp_path)})
    args, kwargs = plugin._rewrite_before_prepare(argv=BASE + ["--hicache-storage-backend", "kvtier", plugin.EXTRA_FLAG, extra])
    assert args == () and "dynamic" in kwargs["argv"]
    assert plugin._rewrite_before_prepare(argv=BASE) is None
    assert plugin._rewrite_before_prepare(BASE) is None
