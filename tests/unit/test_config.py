"""Settings precedence: YAML file < POISE_* environment < flags; mistakes are named."""

import pytest

from poise.config import ConfigError, load_settings


def test_file_then_env_then_flags(tmp_path):
    f = tmp_path / "poise.yaml"
    f.write_text("model: /m\nport: 9000\nmax-num-seqs: 8\napi_keys: [a]\ndrain_timeout_s: 5\n")
    env = {"POISE_PORT": "9100", "POISE_API_KEYS": "b, c", "POISE_QUEUE_TARGET_S": "0.4"}
    s = load_settings({"port": 9200, "host": None}, f, env)
    assert s.port == 9200  # flag over env over file
    assert s.api_keys == ["b", "c"]  # env over file
    assert s.max_num_seqs == 8 and s.drain_timeout_s == 5  # file
    assert s.queue_target_s == 0.4
    assert s.host == "127.0.0.1"  # an absent flag changes nothing
    assert s.model_name == "m"


@pytest.mark.parametrize(
    ("flags", "text", "needle"),
    [
        ({"model": "/m"}, "prot: 1\n", "prot"),
        ({"model": "/m", "port": 70000}, "", "port"),
        ({}, "", "model"),
        ({"model": "/m"}, "- not a mapping\n", "mapping"),
        ({"model": "/m"}, "port: [\n", "YAML"),
    ],
)
def test_mistakes_are_named(tmp_path, flags, text, needle):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_settings(flags, f, {})


def test_generation_config_from_env_and_named_when_wrong(tmp_path):
    assert load_settings({"model": "/m"}, None, {}).generation_config == "auto"
    env = {"POISE_GENERATION_CONFIG": "none"}
    assert load_settings({"model": "/m"}, None, env).generation_config == "none"
    with pytest.raises(ConfigError, match="generation_config"):
        load_settings({"model": "/m", "generation_config": "vllm"}, None, {})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"model": "/m"}, tmp_path / "nope.yaml", {})


def test_poise_up_shares_the_cores_among_its_replicas(monkeypatch):
    from poise.launcher import replica_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert replica_env(2)["OMP_NUM_THREADS"] == "4"
    assert replica_env(16)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert replica_env(2)["OMP_NUM_THREADS"] == "3"
