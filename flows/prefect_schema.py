"""A new workspace's Prefect database, restored from a dump of its schema instead of migrated.

The embedded default's temporary Prefect API keeps its SQLite database in the workspace (``flows.local_pipeline``).
On a new workspace, the server's first start runs Prefect's ~150 Alembic migrations: ~10 s of CPU, on the
critical path of `rlhf run`'s first stage (docs/results/demo.md). The result is always the same empty schema, so
it is kept here as SQL text, one file per Prefect version (``prefect_schema/prefect-<version>.sql``, written by
``python -m flows.prefect_schema`` from Prefect's own migrations; ``make generated``), and ``restore`` writes it
into a new database in milliseconds. Prefect's start then finds its Alembic head and migrates nothing.

A Prefect version without its dump gets no database from here: Prefect migrates one as before. The dump's
statements are compared with a fresh migration's in tests/flows/test_prefect_schema.py, ignoring the order of a
table's constraints (Alembic's table rebuilds emit them in set order).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

SCHEMA_DIR = Path(__file__).with_name("prefect_schema")


def schema_file(prefect_version: str | None = None) -> Path:
    """The dump for ``prefect_version`` (default: the installed Prefect's)."""
    return SCHEMA_DIR / f"prefect-{prefect_version or version('prefect')}.sql"


def restore(db: Path, prefect_version: str | None = None) -> bool:
    """Create ``db`` from the dump of ``prefect_version``'s schema (default: the installed Prefect's); False, with
    nothing written, when ``db`` exists or there is no dump for that version. Written under a temporary name and
    renamed: a crash leaves no half-made database for Prefect to find."""
    dump = schema_file(prefect_version)
    if db.exists() or not dump.is_file():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    partial = db.with_name(f".{db.name}.partial")
    partial.unlink(missing_ok=True)
    with sqlite3.connect(partial) as conn:
        conn.executescript(dump.read_text())
    conn.close()
    os.replace(partial, db)
    return True


def migrated_dump() -> str:
    """The SQL dump of an empty database migrated by Prefect's own command (``prefect server database upgrade``),
    in a temporary ``PREFECT_HOME`` with every other Prefect setting cleared (no profile, no database URL)."""
    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": home}
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with sqlite3.connect(Path(home) / "prefect.db") as conn:
            text = "\n".join(conn.iterdump()) + "\n"
        conn.close()
    return text


def main() -> None:
    """Write the installed Prefect's dump and remove the other versions'."""
    target = schema_file()
    SCHEMA_DIR.mkdir(exist_ok=True)
    target.write_text(migrated_dump())
    for old in SCHEMA_DIR.glob("prefect-*.sql"):
        if old != target:
            old.unlink()
    print(f"wrote {target.relative_to(Path.cwd()) if target.is_relative_to(Path.cwd()) else target}")


if __name__ == "__main__":
    main()
