"""``tandem up --config FILE``: the file parsed (TOML and YAML), its versions planned onto
workers of their own, its traffic policy checked before any worker boots."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.models import GenerationDefaults
from gateway.assembly.config_file import ConfigFileError, load_stack_file
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack
from tests.fakes.model_folder import fake_version
from versions.records import ModelVersion
from workers.process import worker_argv

TOML = """
[[versions]]
label = "baseline"
alias = "smol"
prefill_workers = 1
decode_workers = 1

[[versions]]
label = "candidate"
alias = "smol"
decode_workers = 1
defaults = { temperature = 0.2, system_prompt = "Be brief." }

[traffic.smol]
split = [{ version = "baseline", weight = 90 }, { version = "candidate", weight = 10 }]
sticky = true
"""

YAML = """
versions:
  - label: baseline
    alias: smol
    prefill_workers: 1
    decode_workers: 1
  - label: candidate
    alias: smol
    decode_workers: 1
    defaults: {temperature: 0.2, system_prompt: Be brief.}
traffic:
  smol:
    split:
      - {version: baseline, weight: 90}
      - {version: candidate, weight: 10}
    sticky: true
"""


def _versions(tmp_path: Path) -> list[ModelVersion]:
    return [
        fake_version(tmp_path / "baseline", "smol"),
        fake_version(
            tmp_path / "candidate",
            "smol",
            defaults=GenerationDefaults(temperature=0.2, system_prompt="Be brief."),
        ),
    ]


@pytest.mark.parametrize(("suffix", "text"), [(".toml", TOML), (".yaml", YAML)])
def test_a_file_plans_each_version_on_workers_of_its_own(
    tmp_path: Path, suffix: str, text: str
) -> None:
    path = tmp_path / f"stack{suffix}"
    path.write_text(text)
    stack_file = load_stack_file(path)
    assert [entry.label for entry in stack_file.versions] == ["baseline", "candidate"]
    assert stack_file.versions[1].generation_defaults.system_prompt == "Be brief."
    baseline, candidate = _versions(tmp_path)
    stack = Stack.from_file(TandemSettings(), stack_file, [baseline, candidate], path)

    deployed = list(stack.deployments)
    assert [d.version for d in deployed] == [baseline.name, candidate.name]
    assert deployed[1].model.defaults.temperature == 0.2
    # Each version counts its prompts with its own tokenizer.
    assert [d.model.tokenizer_dir for d in deployed] == [
        Path(baseline.model_dir),
        Path(candidate.model_dir),
    ]
    names = [w.name for d in deployed for w in d.workers]
    assert names == ["prefill-0", "decode-0", f"{candidate.version_id[:8]}-decode-0"]
    specs = [spec for pool in stack.supervisor.pools() for spec in pool.config.specs]
    ports = [port for spec in specs for port in (spec.port, spec.side_channel_port)]
    assert len(set(ports)) == len(ports), "every HTTP and side-channel port differs"
    served = [argv[argv.index("--served-model-name") + 1] for argv in map(worker_argv, specs)]
    assert served == [baseline.name, baseline.name, candidate.name]
    # The first version's workers as TANDEM_CPU_BINDING says; a later one's round-robin over it.
    assert [spec.cpu_bind for spec in specs] == ["0", "1", "0"]
    [(alias, policy)] = stack.declared.policies
    assert alias == "smol"
    assert policy["split"] == [
        {"version": baseline.name, "weight": 90},
        {"version": candidate.name, "weight": 10},
    ]
    assert policy["sticky"] is True
    assert stack.declared.register == (baseline, candidate)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("versions = []", "versions"),
        ('[[versions]]\nlabel = "a"\nbogus = 1', "bogus"),
        ('[[versions]]\nlabel = "a"\n[[versions]]\nlabel = "a"', "unique"),
        ('[[versions]]\nlabel = "a"\ndefaults = { temperature = 9 }', "temperature"),
        ('[[versions]]\nlabel = "a"\ndecode_workers = -1', "decode_workers"),
        ('[[versions]]\nlabel = "a"\ndecode_urls = ["gpu-a:8000"]', "decode_urls.0.*http"),
        ("[[versions]\n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "stack.toml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=says) as caught:
        load_stack_file(path)
    assert str(path) in str(caught.value)


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_stack_file(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("traffic", "says"),
    [
        ('split = [{ version = "baseline", weight = 90 }]', "split"),
        ('split = [{ version = "nobody", weight = 100 }]', "no version labelled 'nobody'"),
        ('split = [{ version = "baseline", weight = 100 }]\nbogus = 1', "bogus"),
        ('split = ["baseline"]', "split"),  # not an object: refused, not a crash
    ],
)
def test_a_bad_policy_is_refused_before_any_worker_boots(
    tmp_path: Path, traffic: str, says: str
) -> None:
    path = tmp_path / "stack.toml"
    path.write_text(TOML.split("[traffic.smol]")[0] + "[traffic.smol]\n" + traffic + "\n")
    stack_file = load_stack_file(path)
    with pytest.raises(ConfigFileError, match=says) as caught:
        Stack.from_file(TandemSettings(), stack_file, _versions(tmp_path), path)
    assert "traffic.smol" in str(caught.value)


def test_a_policy_naming_another_aliases_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    other = '[traffic.other]\nsplit = [{ version = "baseline", weight = 100 }]\n'
    path.write_text(TOML.split("[traffic.smol]")[0] + other)
    stack_file = load_stack_file(path)
    with pytest.raises(ConfigFileError, match="does not exist") as caught:
        Stack.from_file(TandemSettings(), stack_file, _versions(tmp_path), path)
    assert "traffic.other.split[0].version" in str(caught.value)
