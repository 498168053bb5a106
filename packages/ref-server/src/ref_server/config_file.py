"""Reading settings from TOML files: one reader for every command, with one kind of error."""

from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_toml(path: str | Path, known: list[str]) -> dict[str, object]:
    """The file's flat keys and values; ValueError naming the file and the problem (missing,
    unreadable, not TOML, unknown keys)."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read config file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {path} is not valid TOML: {error}") from None
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"config file {path} has unknown keys: {', '.join(unknown)}; "
            f"known keys: {', '.join(known)}"
        )
    return values
