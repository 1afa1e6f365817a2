"""Read, merge and write run configurations: the YAML plumbing every layer may use.

A schema is a dataclass (the run's, `pixelrl.config.PixelRLConfig`, is composed from the sections
each component defines); a YAML file from `configs/` sets values; command-line overrides use
OmegaConf dotted syntax (`rollout.n=8`). Unknown keys and wrong types stop here with one
`ConfigError` naming the field; the checks of what the values mean live with each section and,
for rules that span sections, in `pixelrl.config`.
"""

from __future__ import annotations

from pathlib import Path

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
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) > 1:  # meant as a file
        where = "is a folder" if candidate.is_dir() else "does not exist"
        raise ConfigError("--config-name", name, f"that YAML file {where} (relative to {Path.cwd()}): check the "
                          "path, or name a bundled config (`pixelrl config --config-name NAME` shows one)")
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError("--config-name", name, f"no such config; use a YAML path or one of {known}")


def _parent_path(path: Path, parent) -> Path:
    """A `defaults` entry of the YAML file `path`: a file next to it (name without .yaml), else a
    bundled config of that name (so a recipe of one's own extends `flow_grpo_sd35`)."""
    beside = path.parent / f"{parent}.yaml"
    if beside.is_file():
        return beside
    bundled = CONFIG_DIR / f"{parent}.yaml"
    if isinstance(parent, str) and "/" not in parent and bundled.is_file():
        return bundled
    raise ConfigError(f"{path}: defaults", parent, f"neither {beside} nor a bundled config of that name exists: "
                      f"name a file next to {path.name} (without .yaml) or a bundled config "
                      "(`pixelrl train --help` lists them)")


def _load_yaml_chain(path: Path, seen: tuple = ()):
    """A YAML file, merged over the configs it lists under `defaults` (each a file next to it, or
    a bundled config)."""
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
        merged = merge_layers(merged, _load_yaml_chain(_parent_path(path, parent), seen + (path,)))
    return merge_layers(merged, node)


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


def config_layers(config_name: str | None = None, overrides: list[str] | tuple = ()) -> list:
    """The named YAML chain and the dotted overrides, as OmegaConf layers to merge over a schema
    (keys that moved rewritten, with a warning)."""
    import yaml
    from omegaconf import OmegaConf

    layers = []
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
    return layers


def saved_layer(text: str):
    """A config written by `saved_yaml` (a run folder's or a checkpoint's), its moved keys
    rewritten silently (a checkpoint saved before a key moved)."""
    from omegaconf import OmegaConf

    return _move_keys(OmegaConf.create(text), warn=False)


def build_config(schema: type, layers: list):
    """The schema's dataclass with `layers` merged over its defaults; an unknown key or a wrong
    type is one ConfigError naming the field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    structured = OmegaConf.structured(schema)
    try:
        merged = merge_layers(structured, *layers)
        from_environment = list(_environment_values(OmegaConf.to_container(merged, resolve=False)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        field = getattr(err, "full_key", None) or "?"
        first_line = str(err).splitlines()[0]
        if "not in" in first_line:
            parent = field.rsplit(".", 1)[0] if "." in field else ""
            node = OmegaConf.select(structured, parent) if parent else structured
            known = sorted(node.keys()) if hasattr(node, "keys") else []
            raise ConfigError(field, layered_value(layers, field, None),
                              f"unknown key{_did_you_mean(field.rsplit('.', 1)[-1], known)}; known keys here: "
                              f"{known}") from None
        if field == "?":  # a whole section given as a list: OmegaConf names no key
            for layer in layers:
                key, value, expected = _container_clash(structured, layer)
                if key:
                    raise ConfigError(key, value, f"must be {expected}, as the schema has it") from None
        raise ConfigError(field, getattr(err, "value", None), _plain_type_error(first_line)) from None
    # the run's workers get these values; files and trackers get the interpolation text (saved_yaml)
    cfg._from_environment = from_environment
    return cfg


def _plain_type_error(message: str) -> str:
    """OmegaConf's type errors in the words of a config file: "Value 'fast' of type 'str' could not
    be converted to Float" -> "must be a number (float)"; a scalar where a list goes -> "must be a
    list"; anything else as OmegaConf says it."""
    import re

    converted = re.search(r"could not be converted to (\w+)", message)
    if converted:
        kind = {"Float": "a number (float)", "Integer": "a whole number", "Boolean": "true or false"}.get(
            converted.group(1), f"a {converted.group(1)}")
        return f"must be {kind}"
    if "is not a ListConfig" in message:
        return "must be a list, e.g. [a, b] (on the command line: key=[a cat, a dog])"
    if "is not a DictConfig" in message or ("Cannot assign" in message and "Dict[" in message):
        return "must be a mapping of keys to values, e.g. {name: x}"
    return message


def _did_you_mean(key: str, known: list[str]) -> str:
    """`, did you mean `lr`?` for a key one or two edits from a known one (else "")."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f", did you mean `{close[0]}`?" if close else ""


def merge_layers(*nodes):
    """OmegaConf's merge of config layers, later over earlier; a key that is a mapping in one
    layer and a list in a later one (`diffusion_loss.params=[1, 2]`) is one ConfigError naming it,
    where OmegaConf raises a bare TypeError."""
    from omegaconf import OmegaConf

    merged = nodes[0]
    for node in nodes[1:]:
        try:
            merged = OmegaConf.merge(merged, node)
        except TypeError:
            key, value, expected = _container_clash(merged, node)
            if not key:
                raise
            example = "{name: x}" if expected == "a mapping of keys to values" else "[a, b]"
            raise ConfigError(key, value, f"must be {expected}, as the config it overrides has it: e.g. "
                              f"{key}={example}") from None
    return merged


def _container_clash(base, node, path: tuple = ()) -> tuple[str, object, str]:
    """(dotted key, value, what it must be) of the first key `node` sets to a list where `base`
    holds a mapping, or the reverse."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    for key in node.keys() if isinstance(node, DictConfig) else ():
        if not isinstance(base, DictConfig) or key not in base:
            continue
        old, new = base._get_node(key), node._get_node(key)
        if isinstance(old, DictConfig) and isinstance(new, ListConfig):
            return ".".join((*path, str(key))), OmegaConf.to_container(new), "a mapping of keys to values"
        if isinstance(old, ListConfig) and isinstance(new, DictConfig):
            return ".".join((*path, str(key))), OmegaConf.to_container(new), "a list"
        if isinstance(old, DictConfig) and isinstance(new, DictConfig):
            found = _container_clash(old, new, (*path, str(key)))
            if found[0]:
                return found
    return "", None, ""


def layered_value(layers: list, key: str, default):
    """The value `key` (dotted) takes once `layers` are merged, before any schema: what decides
    the schema itself (the trainer type)."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(merge_layers(*layers) if layers else OmegaConf.create(), key, default=default)
    return default if value is None else value


def to_yaml(cfg) -> str:
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


def saved_yaml(cfg) -> str:
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
