"""Declaring adapters: LoRAConfig's accepted forms of lora_modules, engine.json's list merged with
vllm_backend's multi_lora.json (ids after engine.json's, paths relative to the version directory), and the
refusals, each naming the file or field."""

import json

import pytest

from pagedllm.config import EngineConfig, LoRAConfig
from pagedllm.serving.launcher import _lora_module
from pagedllm.serving.multi_lora import with_multi_lora


def test_lora_modules_forms_normalise_to_name_path_id():
    forms = [{"a": "/x", "b": "/y"}, [{"name": "a", "path": "/x"}, {"name": "b", "path": "/y"}], ["a=/x", "b=/y"]]
    for form in forms:
        assert LoRAConfig(enable_lora=True, lora_modules=form).lora_modules == (("a", "/x", 1), ("b", "/y", 2))
    explicit = LoRAConfig(enable_lora=True, lora_modules=[{"name": "a", "path": "/x", "id": 7}, "b=/y"])
    assert explicit.lora_modules == (("a", "/x", 7), ("b", "/y", 8))
    cfg = EngineConfig.from_kwargs("m", enable_lora=True, max_loras=3, lora_modules={"a": "/x"})
    assert cfg.lora.max_loras == 3 and cfg.lora.lora_modules == (("a", "/x", 1),)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_modules={"a": "/x"}), "need enable_lora"),
    (dict(max_loras=4), "max_loras: has no effect without enable_lora"),
    (dict(max_cpu_loras=8), "max_cpu_loras: has no effect without enable_lora"),
    (dict(enable_lora=True, lora_modules=[{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]), "names repeat"),
    (dict(enable_lora=True, lora_modules=[{"name": "a", "path": "/x", "id": 2}, "b=/y", {"name": "c", "path": "/z",
                                                                                          "id": 3}]), "ids repeat"),
    (dict(enable_lora=True, lora_modules=[{"name": "a"}]), "a name and a path"),
    (dict(enable_lora=True, max_loras=0), "max_loras"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
])
def test_bad_declarations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_multi_lora_json_joins_engine_json(tmp_path):
    (tmp_path / "multi_lora.json").write_text(json.dumps({"b": "adapters/b", "c": "/abs/c"}))
    args = with_multi_lora({"model": "m", "enable_lora": True, "lora_modules": {"a": "/abs/a"}}, str(tmp_path))
    assert args["lora_modules"] == [{"name": "a", "path": "/abs/a", "id": 1},
                                    {"name": "b", "path": str(tmp_path / "adapters" / "b"), "id": 2},
                                    {"name": "c", "path": "/abs/c", "id": 3}]
    assert with_multi_lora({"model": "m"}, str(tmp_path / "nowhere")) == {"model": "m"}


@pytest.mark.parametrize("content, message", [("{broken", "cannot be read"), ('["a"]', "expected an object"),
                                              ('{"a": "/y"}', "names repeat")])
def test_bad_multi_lora_json_is_refused_naming_the_file(tmp_path, content, message):
    (tmp_path / "multi_lora.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        with_multi_lora({"enable_lora": True, "lora_modules": {"a": "/x"}}, str(tmp_path))


def test_serve_lora_modules_argument(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _lora_module("sql=adapters/sql") == f"sql={tmp_path / 'adapters' / 'sql'}"
    with pytest.raises(SystemExit, match="NAME=PATH"):
        _lora_module("sql")
