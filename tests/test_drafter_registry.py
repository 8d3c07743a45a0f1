"""The drafter registry and the method registry: one `DrafterKind` per drafter (with its `Training`, what
train/ asks of it), one `DrafterRef` for the forms a call names a drafter in, one object per decoding
method."""

import json
from pathlib import Path

import pytest

from spd_jax import methods
from spd_jax.config import ModelConfig
from spd_jax.drafters import registry
from spd_jax.drafters.kind import DrafterRef, Form, Training
from spd_jax.costs.cycle import default_plan
from train.config import DrafterConfig


def test_drafter_ref_takes_the_older_forms():
    assert DrafterRef.of(None).form is Form.SHIPPED
    assert DrafterRef.of("random").form is Form.RANDOM
    assert DrafterRef.of("some/dir") == DrafterRef.trained("some/dir")
    assert DrafterRef.of(Path("d")).path == Path("d")
    given = DrafterRef.of(("cfg", {"params": {}}))
    assert given.form is Form.GIVEN and given.config == "cfg"
    ref = DrafterRef.random()
    assert DrafterRef.of(ref) is ref
    with pytest.raises(TypeError, match="a drafter is a checkpoint path"):
        DrafterRef.of(3)


def test_every_kind_is_whole():
    assert set(registry.KINDS) == {"psm", "eagle3", "ppsd"}
    for name, k in registry.KINDS.items():
        assert k.name == name and k.identity_file == f"{name}.json"
        # a trained one ships for the PSM and EAGLE-3; none yet for PPSD (its runs are scheduled)
        assert any(k.shipped_dir.glob(f"*/{k.identity_file}")) == (name != "ppsd"), name
        assert (k.staged and k.random_flag and k.teacher_drafts) or not (k.staged or k.teacher_drafts)
        for meta in k.shipped_dir.glob(f"*/{k.identity_file}"):
            spec = registry.store.read_spec(k, meta.parent)  # the shipped identity files read unchanged
            assert isinstance(spec, k.config) and registry.of_checkpoint(meta.parent) is k
            assert k.from_json(k.to_json(spec), str(meta.parent)) == spec
    with pytest.raises(ValueError, match="unknown drafter 'x': one of psm, eagle3, ppsd"):
        registry.kind("x")


def test_every_kind_trains_through_its_training_record():
    """What train/ asks of a kind, asked of each the same way: the config a run trains is the kind's (and
    leads back to it), the quick eval's headline is one of its figures, the identity reads back."""
    cfg = ModelConfig.named("tiny-llama")
    assert len({k.training.export_dir for k in registry.KINDS.values()}) == len(registry.KINDS)
    for name, k in registry.KINDS.items():
        t, d = k.training, DrafterConfig(method=name)
        assert isinstance(t, Training) and d.kind is k
        spec = t.config(cfg, default_plan(cfg, 2) if k.staged else None, d)
        assert isinstance(spec, k.config) and registry.of_config(spec) is k
        assert t.metric in t.eval_summary(spec, 12, 4, d)
        assert "written to out/x" in t.exported(Path("out/x"), spec, 3, d) and " for m: " in t.describe("m", spec, d)
        recorded = json.loads(json.dumps(k.to_json(spec)))  # as run.json holds it
        assert json.loads(json.dumps(t.recorded_spec(recorded))) == recorded
        json.dumps([t.identity(d), t.trained(d)])  # run.json and the export's record hold them
    with pytest.raises(TypeError, match="dict is no drafter kind's config"):
        registry.of_config({})


def test_methods_are_objects_with_their_own_caches():
    assert list(methods.METHODS) == ["ar", "tp", "pipeline", "spd", "ppsd", "eagle3"]
    caches = [m.compiled for m in methods.METHODS.values()]
    assert len({id(c) for c in caches}) == len(caches)
    spd, ppsd = methods.get("spd"), methods.get("ppsd")
    assert spd.drafter_kind is registry.PSM and methods.get("eagle3").drafter_kind is registry.EAGLE3
    assert ppsd.drafter_kind is registry.PPSD and methods.of_drafter(registry.PPSD) is ppsd
    assert methods.SPD(n=4, psm_placement="own").devices() == 5
    assert methods.PPSD(n=4).devices() == 4  # its head runs on stage 0's device
    assert methods.Pipeline(n=4, psm_placement="own").devices() == 4
    assert methods.AR.taking(n=4).devices() == 1 and methods.AR.taking(n=4) == methods.AR()
    # the options are the method: a name is its defaults, an object goes as it is, each class one cache
    assert methods.get("spd") == methods.SPD() and methods.get(spd) is spd
    assert methods.SPD(n=4).compiled is spd.compiled is methods.SPD.compiled
    with pytest.raises(ValueError, match="unknown method 'x': available: ar, tp, pipeline, spd, ppsd, eagle3"):
        methods.get("x")
    with pytest.raises(ValueError, match="eagle3 needs a positive chain length k"):
        methods.EAGLE3(k=0)
    with pytest.raises(ValueError, match="unknown drafter 'bogus' for the pipelined methods"):
        methods.SPD(drafter="bogus")
    with pytest.raises(TypeError):
        methods.AR(n=2)  # an option the method does not take


def test_what_callers_ask_of_a_method_instead_of_its_name():
    ar, spd, e3 = methods.get("ar"), methods.get("spd"), methods.get("eagle3")
    assert [m.name for m in methods.METHODS.values() if m.baseline] == ["ar"]
    assert (spd.label_key, e3.label_key, ar.label_key, methods.get("ppsd").label_key) == (
        "psm", "drafter_spec", None, "ppsd")
    assert (methods.SPD.taking(spec="a", drafter_spec="b").drafter_ref(),
            methods.PPSD(spec="a", drafter_spec="b").drafter_ref()) == ("a", "b")
    assert (ar.steps(dict(tokens=5)), spd.steps(dict(cycles=7)), e3.steps(dict(rounds=2))) == (5, 7, 2)
    assert [m.name for m in methods.METHODS.values() if not m.multi_process] == ["ar", "eagle3"]
    assert not registry.is_checkpoint("random") and not registry.is_checkpoint("given")
    assert not registry.is_checkpoint(None) and registry.is_checkpoint("/some/psm")
