"""The capture hooks name modules that exist, once each, in the class SGLang builds (see conftest.py: run
once per version).

SGLang builds the class config.json names in ``architectures`` and matches each ``forward_hooks`` spec
with fnmatch against that class's ``named_modules()`` names, only warning when nothing matches
(``model_executor/hook_manager.py``). A multimodal wrapper nests its text model: Kimi-K2.5 is
``KimiK25ForConditionalGeneration`` with ``self.language_model = DeepseekV3ForCausalLM(...)``, so its
decoder layers are ``language_model.model.layers.<i>`` and not ``model.layers.<i>``.

Models need CUDA to build, so the module tree is read from each version's source instead: every
``self.<name> = <Class>(...)`` (and ``self.layers, ... = make_layers(...)``) in ``__init__`` along a
class's bases, each class found through its file's imports, nested as SGLang would nest the modules
(``SourceTree``). Each entry of ``eagle3_ray.engines.sglang_modules.SGLANG_MODULES`` is checked against
it: the file it cites registers the class, the attribute chain leads to a text ``*ForCausalLM`` of the
table whose ``model.layers`` and ``logits_processor`` we hook, and the aux states reach that
``logits_processor`` where the entry says so. The Kimi-K2.5 preset's hooks (configs/kimi-k2.5.yaml, TP 8)
go through SGLang's real ``register_forward_hooks`` over a module tree with those names.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sglang.srt.model_executor.hook_manager import register_forward_hooks

from eagle3_ray.config import load_config
from eagle3_ray.engines.sglang_args import AUX_FLAG, engine_kwargs, server_args_fields
from eagle3_ray.engines.describe import describe_target
from eagle3_ray.engines.sglang_hooks import AUX_ARG
from eagle3_ray.engines.sglang_modules import SGLANG_MODULES, ModulePaths, sglang_module_paths
from eagle3_ray.errors import ConfigError

from conftest import source_root

SRT = source_root() / "srt"
REPO = Path(__file__).resolve().parents[2]
FIELDS = server_args_fields()
HAS_AUX_FLAG = AUX_FLAG in FIELDS
LAYER_FACTORIES = {"make_layers", "make_pp_layers"}
# Text CausalLMs of the table (no wrapper): what a wrapper's language model must be.
CAUSAL_LMS = {arch for arch, paths in SGLANG_MODULES.items() if not paths.language_model}
WRAPPERS = sorted(set(SGLANG_MODULES) - CAUSAL_LMS)


# --- the module tree, read from SGLang's source ----------------------------------------------------


@dataclass(frozen=True)
class Child:
    """``self.<attr> = ...`` in a class's ``__init__``: a module of class ``cls`` (None: not found in
    SGLang's source, e.g. nn.ModuleList), or the decoder stack of ``make_layers`` (``layers``)."""

    attr: str
    cls: tuple[str, ast.ClassDef] | None  # (file under srt/, class) where found
    layers: bool
    where: str  # file:line of the assignment


class SourceTree:
    """Classes of ``sglang/srt`` read with ast and found through each file's ``from sglang.srt... import``."""

    def __init__(self) -> None:
        self._trees: dict[str, ast.Module] = {}

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            self._trees[rel] = ast.parse((SRT / rel).read_text(encoding="utf-8-sig"))
        return self._trees[rel]

    def find(self, rel: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """Class ``name`` as seen from file ``rel``: defined there or imported from another srt file."""
        tree = self.tree(rel)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return rel, node
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt.")):
                continue
            for alias in node.names:
                if (alias.asname or alias.name) == name and depth < 4:
                    base = Path(*node.module.split(".")[2:])
                    for cand in (base.with_suffix(".py"), base / "__init__.py"):
                        if (SRT / cand).is_file():
                            return self.find(str(cand), alias.name, depth + 1)
        return None

    def mro(self, rel: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its SGLang bases, most derived first."""
        out = [(rel, cls)]
        for base in cls.bases:
            found = self.find(rel, ast.unparse(base).split(".")[-1])
            if found is not None:
                out += self.mro(*found)
        return out

    def method(self, rel: str, cls: ast.ClassDef, name: str) -> tuple[str, ast.FunctionDef] | None:
        for r, c in self.mro(rel, cls):
            for node in c.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return r, node
        return None

    def children(self, rel: str, cls: ast.ClassDef) -> dict[str, Child]:
        """Submodules assigned in ``__init__`` along the bases (a subclass's assignment wins)."""
        out: dict[str, Child] = {}
        for r, c in reversed(self.mro(rel, cls)):
            init = next((n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is None:
                continue
            for node in ast.walk(init):
                if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                    continue
                target, call = node.targets[0], node.value
                func = ast.unparse(call.func)
                where = f"{r}:{node.lineno}"
                if func.split(".")[-1] in LAYER_FACTORIES:  # self.layers[, self.start_layer, ...] = make_layers(...)
                    first = target.elts[0] if isinstance(target, ast.Tuple) else target
                    out[ast.unparse(first).removeprefix("self.")] = Child("layers", None, True, where)
                    continue
                if not (isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self"):
                    continue
                if func.startswith("self."):  # a builder method, e.g. LlamaForCausalLM._init_model
                    found = self.method(rel, cls, func.removeprefix("self."))
                    returns = [n.value for n in ast.walk(found[1]) if isinstance(n, ast.Return)
                               and isinstance(n.value, ast.Call)] if found else []
                    func = ast.unparse(returns[0].func) if returns else func
                out[target.attr] = Child(target.attr, self.find(r, func.split(".")[-1]), False, where)
        return out

    def names(self, rel: str, cls: ast.ClassDef, num_layers: int, prefix: str = "", depth: int = 0) -> set[str]:
        """The ``named_modules()`` names under a class, as far as its SGLang children go (3 levels)."""
        out: set[str] = set()
        for attr, child in self.children(rel, cls).items():
            name = f"{prefix}{attr}"
            out.add(name)
            if child.layers:
                out |= {f"{name}.{i}" for i in range(num_layers)}
            elif child.cls is not None and depth < 3 and child.cls[0].startswith("models/"):
                out |= self.names(*child.cls, num_layers, f"{name}.", depth + 1)
        return out


@pytest.fixture(scope="module")
def source() -> SourceTree:
    return SourceTree()


def _arch_class(source: SourceTree, arch: str, paths: ModulePaths) -> tuple[str, ast.ClassDef]:
    """The class the entry cites (``models/<file>.py: ...``), which that file registers as ``arch``."""
    rel = paths.source.split(":")[0]
    tree = source.tree(rel)
    entry = [n for n in tree.body if isinstance(n, ast.Assign)
             and any(getattr(t, "id", None) == "EntryClass" for t in n.targets)]
    assert entry, f"sglang/srt/{rel} registers no EntryClass"
    registered = {n.id for n in ast.walk(entry[0].value) if isinstance(n, ast.Name)}
    assert arch in registered, f"sglang/srt/{rel} no longer registers {arch} (EntryClass: {sorted(registered)})"
    found = source.find(rel, arch)
    assert found is not None and found[0] == rel, f"class {arch} is gone from sglang/srt/{rel}"
    return found


def _causal_lm(source: SourceTree, arch: str, paths: ModulePaths) -> tuple[str, ast.ClassDef, list[str]]:
    """Follow the entry's ``language_model`` path to the text CausalLM: (file, class, assignments)."""
    rel, cls = _arch_class(source, arch, paths)
    chain = []
    for attr in filter(None, paths.language_model.split(".")):
        child = source.children(rel, cls).get(attr)
        assert child is not None and child.cls is not None, f"{cls.name}.__init__ no longer sets self.{attr} = <model>"
        rel, cls = child.cls
        chain.append(f"{attr} = {cls.name} ({child.where})")
    return rel, cls, chain


# --- every table entry, against this version's source ----------------------------------------------


@pytest.mark.parametrize("arch", sorted(SGLANG_MODULES))
def test_entry_names_the_decoder_layers_and_logits_processor(source, arch):
    paths = SGLANG_MODULES[arch]
    rel, cls, chain = _causal_lm(source, arch, paths)
    # A wrapper holds one of the table's text CausalLMs (so its inner layout is checked as that entry).
    assert not paths.language_model or cls.name in CAUSAL_LMS, (arch, chain)
    kids = source.children(rel, cls)
    model, lp = kids.get("model"), kids.get("logits_processor")
    assert model is not None and model.cls is not None, f"{cls.name}.__init__ sets no self.model = <decoder model>"
    stack = source.children(*model.cls).get("layers")
    assert stack is not None and stack.layers, f"{model.cls[1].name} no longer builds self.layers with make_layers"
    assert lp is not None and lp.cls is not None and lp.cls[1].name == "LogitsProcessor", f"{cls.name}.logits_processor"
    # The same names in the whole tree of the class SGLang builds, each exactly once (no pattern characters).
    names = source.names(*_arch_class(source, arch, paths), num_layers=4)
    wanted = [paths.decoder_layer(i) for i in range(4)] + [paths.logits_processor]
    assert set(wanted) <= names, sorted(set(wanted) - names)
    for name in wanted:
        assert not set("*?[") & set(name) and [n for n in names if fnmatch.fnmatch(n, name)] == [name]


@pytest.mark.parametrize("arch", WRAPPERS)
def test_wrapper_runs_its_language_model(source, arch):
    """The wrapper's forward hands its batch to the language model, whose forward runs the hooked modules."""
    paths = SGLANG_MODULES[arch]
    rel, cls = _arch_class(source, arch, paths)
    forward = source.method(rel, cls, "forward")
    routine = [c for c in ast.walk(forward[1]) if isinstance(c, ast.Call)
               and ast.unparse(c.func) == "general_mm_embed_routine"]
    assert routine, f"{arch}.forward no longer calls general_mm_embed_routine"
    handed = {k.arg: ast.unparse(k.value) for k in routine[0].keywords}
    assert handed.get("language_model") == f"self.{paths.language_model}", handed
    fn = next(n for n in source.tree("managers/mm_utils.py").body
              if isinstance(n, ast.FunctionDef) and n.name == "general_mm_embed_routine")
    assert any(isinstance(c, ast.Call) and ast.unparse(c.func) == "language_model" for c in ast.walk(fn)), \
        "managers/mm_utils.py:general_mm_embed_routine no longer calls language_model(...)"


def test_kimi_k25_has_no_model_submodule(source):
    """``KimiK25ForConditionalGeneration.model`` is a property and ``__setattr__`` drops ``model``: no
    ``model.*`` alias registers the language model under a second name (named_modules keeps one)."""
    rel, cls = _arch_class(source, "KimiK25ForConditionalGeneration", SGLANG_MODULES["KimiK25ForConditionalGeneration"])
    model = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "model")
    assert [ast.unparse(d) for d in model.decorator_list] == ["property"]
    assert ast.unparse(model.body[-1]) == "return self.language_model"
    setattr_ = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__setattr__")
    drops = [n for n in setattr_.body if isinstance(n, ast.If) and ast.unparse(n.test) == "name == 'model'"]
    assert drops and ast.unparse(drops[0].body[0]) == "return", ast.unparse(setattr_)
    assert "model" not in source.children(rel, cls)


@pytest.mark.parametrize("arch", sorted(SGLANG_MODULES))
def test_aux_states_reach_the_hooked_logits_processor_where_the_entry_says(source, arch):
    """SGLang calls ``set_eagle3_layers_to_capture`` on the class it built; a wrapper must hand it to its
    language model, whose forward passes the aux states to the ``logits_processor`` we hook."""
    paths = SGLANG_MODULES[arch]
    setup = (SRT / "model_executor/model_runner_components/attention_backend_setup.py").read_text(encoding="utf-8")
    assert "model.set_eagle3_layers_to_capture(eagle_aux_hidden_state_layer_ids)" in setup
    rel, cls = _arch_class(source, arch, paths)
    top = source.method(rel, cls, "set_eagle3_layers_to_capture")
    if not paths.aux_states:
        assert top is None, f"{arch} now has set_eagle3_layers_to_capture: check it and set aux_states=True"
        return
    assert top is not None, f"{arch} has no set_eagle3_layers_to_capture: SGLang cannot hand it aux states"
    if paths.language_model:
        assert f"self.{paths.language_model}.set_eagle3_layers_to_capture(layer_ids)" in ast.unparse(top[1])
    lm_rel, lm_cls, _ = _causal_lm(source, arch, paths)
    assert source.method(lm_rel, lm_cls, "set_eagle3_layers_to_capture") is not None
    forward = source.method(lm_rel, lm_cls, "forward")
    calls = [c for c in ast.walk(forward[1]) if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.logits_processor"]
    assert calls, f"{lm_cls.name}.forward no longer calls self.logits_processor"
    for c in calls:
        assert len(c.args) > AUX_ARG and ast.unparse(c.args[AUX_ARG]) == "aux_hidden_states", ast.unparse(c)


# --- what the engine generates ---------------------------------------------------------------------


def test_unknown_architectures_and_foreign_model_impls_are_refused():
    with pytest.raises(ConfigError, match="LlavaForConditionalGeneration.*SGLANG_MODULES"):
        sglang_module_paths(["LlavaForConditionalGeneration"])
    with pytest.raises(ConfigError, match="model_impl='transformers'"):
        sglang_module_paths(["LlamaForCausalLM"], {"model_impl": "transformers"})
    assert sglang_module_paths(["KimiK25ForConditionalGeneration"], {"model_impl": "sglang"}).language_model


def test_aux_path_refuses_a_wrapper_without_aux_states(tmp_path, kimi):
    target, info = kimi
    audio = dataclasses.replace(info, architectures=("Qwen2AudioForConditionalGeneration",))
    with pytest.raises(ConfigError, match="Qwen2AudioForConditionalGeneration does not hand set_eagle3"):
        engine_kwargs(target, "capture", info=audio, capture_dir=tmp_path, fields=FIELDS | {AUX_FLAG})
    # Without the flag the layer hooks serve it (tp 1: the TP guard is test_tp_reduced.py's).
    hooks = engine_kwargs(target.model_copy(update={"tp_size": 1}), "capture", info=audio, capture_dir=tmp_path,
                          fields=FIELDS - {AUX_FLAG})["forward_hooks"]
    assert hooks[-1]["target_modules"] == ["language_model.logits_processor"]


KIMI_CONFIG = {  # the shape of Kimi-K2.5's config.json (the preset's /models path is not here)
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
                    "hidden_size": 7168, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
                    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128},
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """configs/kimi-k2.5.yaml's target (TP 8) on a Kimi-K2.5-shaped config.json, described as the engine does."""
    d = tmp_path_factory.mktemp("kimi-k2.5")
    (d / "config.json").write_text(json.dumps(KIMI_CONFIG))
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    target = cfg.target.model_copy(update={"model": str(d)})
    info = describe_target(target)
    # The text model_type: transformers 5.24 maps kimi_k2 to deepseek_v3, 5.12 (SGLang 0.5.17's pin) keeps it.
    assert info.model_type in ("deepseek_v3", "kimi_k2") and (info.architectures, info.num_layers, target.tp_size) == (
        ("KimiK25ForConditionalGeneration",), 61, 8)
    return target, info


def _module_tree(names: set[str]) -> torch.nn.Module:
    """Empty modules nested under those names (what ``named_modules()`` of SGLang's model would list)."""
    root = torch.nn.Module()
    for name in sorted(names, key=lambda n: n.count(".")):
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.ModuleList() if leaf == "layers" else torch.nn.Module())
    return root


def test_kimi_preset_hooks_register_once_each_in_kimi_k25(source, kimi, tmp_path, monkeypatch, caplog):
    """The preset's capture kwargs on this version hook modules of KimiK25ForConditionalGeneration's tree,
    each exactly once, through SGLang's own register_forward_hooks; the old top-level names match nothing."""
    monkeypatch.delenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", raising=False)
    target, info = kimi
    kw = engine_kwargs(target, "capture", info=info, capture_dir=tmp_path, fields=FIELDS)
    specs = kw["forward_hooks"]
    targets = [m for spec in specs for m in spec["target_modules"]]
    paths = SGLANG_MODULES["KimiK25ForConditionalGeneration"]
    names = source.names(*_arch_class(source, "KimiK25ForConditionalGeneration", paths), num_layers=info.num_layers)
    assert set(targets) <= names, sorted(set(targets) - names)

    model = _module_tree(names)
    caplog.set_level(logging.INFO, logger="sglang.srt.model_executor.hook_manager")
    register_forward_hooks(model, specs)
    hooked = {name: len(m._forward_hooks) for name, m in model.named_modules() if m._forward_hooks}
    assert hooked == {name: 1 for name in targets}
    assert "No modules matched" not in caplog.text
    if HAS_AUX_FLAG:  # SGLang's aux states, handed to the language model's logits_processor
        assert targets == ["language_model.logits_processor"]
    else:  # HF [2, 30, 58]: the outputs of decoder layers 1, 29, 57
        assert targets == ["language_model.model.layers.1", "language_model.model.layers.29",
                           "language_model.model.layers.57", "language_model.logits_processor"]

    # The names the engine used to send (top-level model.layers.<k-1>, logits_processor): none exists.
    old = [{**spec, "target_modules": [m.removeprefix("language_model.") for m in spec["target_modules"]]}
           for spec in specs]
    assert not {m for spec in old for m in spec["target_modules"]} & names
    caplog.clear()
    fresh = _module_tree(names)
    register_forward_hooks(fresh, old)
    assert not any(m._forward_hooks for m in fresh.modules())
    assert caplog.text.count("No modules matched") == len(old)
