"""Read, merge and write run configurations: the YAML plumbing every layer may use.

Dataclasses (`pixelrl.core.config`) are the schema; a YAML file from `configs/` sets values;
command-line overrides use OmegaConf dotted syntax (`rollout.n=8`). Unknown keys and wrong types
stop here with one `ConfigError` naming the field; the checks of what the values mean live in
`pixelrl.config`, above the components whose choices they check.
"""

from __future__ import annotations

from pathlib import Path

from pixelrl.core.config import TRAINER_TYPE_ALIASES, PixelRLConfig
from pixelrl.core.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def config_path(name: str) -> Path:
    """`name` is a config in pixelrl's configs folder (with or without .yaml) or a YAML path."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    bundled = CONFIG_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if bundled.is_file():
        return bundled
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError("--config-name", name, f"no such config; use a YAML path or one of {known}")


def _load_yaml_chain(path: Path, seen: tuple = ()):
    """A YAML file, merged over the configs it lists under `defaults` (each relative to it)."""
    from omegaconf import OmegaConf

    if path in seen:
        raise ConfigError("defaults", str(path), "configs include each other in a loop")
    import yaml
    from omegaconf import DictConfig

    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError("--config-name", str(path), f"not valid YAML{where}: {problem}; fix the file "
                          "(indentation, brackets, a `key: value` per line)") from None
    if not isinstance(node, DictConfig):
        raise ConfigError("--config-name", str(path), f"the file holds a {type(node).__name__}, not a mapping of "
                          "config sections (model:, rollout:, ...)")
    parents = node.pop("defaults", []) if "defaults" in node else []
    merged = OmegaConf.create()
    for parent in parents:
        merged = OmegaConf.merge(merged, _load_yaml_chain(config_path(str(path.parent / f"{parent}.yaml")), seen + (path,)))
    return OmegaConf.merge(merged, node)


def _not_yaml(text: str) -> bool:
    import yaml

    try:
        yaml.safe_load(text)
        return False
    except yaml.YAMLError:
        return True


# keys that moved into the params of the component they configure (2026-11) -> (where they live
# now, their default then: a checkpoint's saved config holds every key, and moves only those it
# set, so that a schedule or loss is not handed params it does not take)
MOVED_KEYS = {"rollout.window_seed": ("rollout.sde_window_params.seed", 0),
              "rollout.mixgrpo_stride": ("rollout.sde_window_params.stride", 1),
              "rollout.mixgrpo_iters_per_group": ("rollout.sde_window_params.iters_per_group", 25),
              "rollout.mixgrpo_rollback": ("rollout.sde_window_params.rollback", False),
              "algorithm.old_policy_schedule": ("diffusion_loss.params.old_policy_schedule", "linear_to_0_5"),
              "algorithm.old_policy_decay": ("diffusion_loss.params.old_policy_decay", 0.0),
              "algorithm.old_policy_update_interval": ("diffusion_loss.params.old_policy_update_interval", 1),
              "algorithm.rollout_policy": ("diffusion_loss.params.rollout_policy", "current")}


def _move_keys(node, warn: bool):
    """Rewrite keys of MOVED_KEYS in a config layer to where they live now (a warning for a
    user's config; a checkpoint's saved config is read silently)."""
    from omegaconf import OmegaConf

    for old, (new, default) in MOVED_KEYS.items():
        section, key = old.rsplit(".", 1)
        parent = OmegaConf.select(node, section)
        if parent is None or not OmegaConf.is_dict(parent) or key not in parent:
            continue
        value = parent.pop(key)
        if warn or value != default:  # a user's own setting moves; a saved default is dropped
            OmegaConf.update(node, new, value, merge=True)
        if warn:
            import warnings

            warnings.warn(f"{old} is now {new} (a param of the component it configures): it is read from "
                          "there; write that in your config", FutureWarning, stacklevel=3)
    return node


def merge_config(config_name: str | None = None, overrides: list[str] | tuple = ()) -> PixelRLConfig:
    """The schema, the named YAML chain and the dotted overrides merged into a config, not yet
    checked (`pixelrl.config.load_config` imports the plugins and validates it)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(PixelRLConfig)
    layers = [schema]
    if config_name:
        layers.append(_move_keys(_load_yaml_chain(config_path(config_name)), warn=True))
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or "" in key.split("."):
            raise ConfigError("<override>", item, "overrides are written section.key=value, e.g. rollout.n=8")
    try:
        layers.append(_move_keys(OmegaConf.from_dotlist(list(overrides)), warn=True))
    except yaml.YAMLError as err:  # a value OmegaConf parses as YAML, e.g. an unclosed list
        bad = next((item for item in overrides if _not_yaml(item.split("=", 1)[1])), "?")
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError("<override>", bad, f"the value is not valid YAML ({problem}): close brackets and quotes, "
                          "e.g. data.prompts=[a cat, a dog]") from None
    try:
        merged = OmegaConf.merge(*layers)
        from_environment = list(_environment_values(OmegaConf.to_container(merged, resolve=False)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        field = getattr(err, "full_key", None) or "?"
        first_line = str(err).splitlines()[0]
        if "not in" in first_line:
            parent = field.rsplit(".", 1)[0] if "." in field else ""
            node = OmegaConf.select(schema, parent) if parent else schema
            known = sorted(node.keys()) if hasattr(node, "keys") else []
            raise ConfigError(field, None, f"unknown key; known keys here: {known}") from None
        raise ConfigError(field, getattr(err, "value", None), first_line) from None
    # the run's workers get these values; files and trackers get the interpolation text (saved_yaml)
    cfg._from_environment = from_environment
    old_name = cfg.algorithm.trainer_type
    if _canonical_trainer_type(cfg) != old_name:
        import warnings

        warnings.warn(f"algorithm.trainer_type={old_name} is the name used before 2026-11: it runs as "
                      f"{cfg.algorithm.trainer_type}; write that in your config", FutureWarning, stacklevel=2)
    return cfg


def _canonical_trainer_type(cfg: PixelRLConfig) -> str:
    """Replace a trainer type's former name with its current one (TRAINER_TYPE_ALIASES)."""
    cfg.algorithm.trainer_type = TRAINER_TYPE_ALIASES.get(cfg.algorithm.trainer_type, cfg.algorithm.trainer_type)
    return cfg.algorithm.trainer_type


def to_yaml(cfg: PixelRLConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _environment_values(node, path: tuple = ()):
    """(path, raw text) of every value interpolated from the environment (`${oc.env:NAME}`)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _environment_values(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _environment_values(value, path + (i,))
    elif isinstance(node, str) and "oc.env:" in node:
        yield path, node


def saved_yaml(cfg: PixelRLConfig) -> str:
    """The config as written into the run folder, its checkpoints and trackers: a value taken
    from the environment (a token, a password in a URL) is written as its `${oc.env:...}` text,
    escaped so reading the file back never looks the variable up. Workers get `to_yaml(cfg)`."""
    from omegaconf import OmegaConf

    text = to_yaml(cfg)
    from_environment = getattr(cfg, "_from_environment", None)
    if not from_environment:
        return text
    data = OmegaConf.to_container(OmegaConf.create(text))
    for path, raw in from_environment:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = raw.replace("${", "\\${")
    return OmegaConf.to_yaml(OmegaConf.create(data))


def from_yaml_text(text: str) -> PixelRLConfig:
    from omegaconf import OmegaConf

    saved = _move_keys(OmegaConf.create(text), warn=False)  # a checkpoint saved before a key moved
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PixelRLConfig), saved))
    _canonical_trainer_type(cfg)  # a checkpoint saved under a former name reads as the current one
    return cfg
