"""A new workspace's Prefect database comes from the dump of Prefect's schema (flows/prefect_schema.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from flows import prefect_schema
from flows.local_pipeline import DATABASE_URL_KEYS, embedded_environment


def statements(dump: str) -> list[tuple[str, ...]]:
    """A dump's statements, each as its sorted lines without trailing commas: Alembic's table rebuilds write a
    table's constraints in set order, which differs from one migration to the next."""
    blocks, current = [], []
    for line in dump.splitlines():
        current.append(line.strip().rstrip(","))
        if line.rstrip().endswith(";"):
            blocks.append(tuple(sorted(current)))
            current = []
    return sorted(blocks)


def dump_of(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return "\n".join(conn.iterdump())
    finally:
        conn.close()


def test_restore_writes_the_dump_once_and_only_for_a_version_it_has(tmp_path):
    db = tmp_path / "home" / "prefect.db"
    assert prefect_schema.restore(db)
    text = prefect_schema.schema_file().read_text()
    assert statements(dump_of(db)) == statements(text)
    assert "INSERT INTO \"alembic_version\"" in text  # Prefect's start reads its head here and migrates nothing
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO alembic_version VALUES ('a run wrote this')")
    conn.commit()
    conn.close()
    assert not prefect_schema.restore(db)  # an existing database is never replaced
    assert "a run wrote this" in dump_of(db)
    other = tmp_path / "other" / "prefect.db"
    assert not prefect_schema.restore(other, prefect_version="0.0.0")  # no dump: Prefect migrates, as before
    assert not other.parent.exists()


def test_the_embedded_default_restores_only_its_own_home(tmp_path, monkeypatch):
    for key in ("PREFECT_HOME", *DATABASE_URL_KEYS):
        monkeypatch.setenv(key, "recorded")  # monkeypatch then restores the key's absence afterwards
        monkeypatch.delenv(key)
    embedded_environment(tmp_path / "a", "ws")
    assert (tmp_path / "a" / "ws" / "prefect" / "prefect.db").is_file()
    monkeypatch.delenv("PREFECT_HOME")
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://db/prefect")
    embedded_environment(tmp_path / "b", "ws")  # a database of the user's: nothing made here
    assert not (tmp_path / "b" / "ws" / "prefect" / "prefect.db").exists()
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "users-home"))
    embedded_environment(tmp_path / "c", "ws")  # the user's home: theirs to migrate
    assert not (tmp_path / "users-home").exists() and not (tmp_path / "c" / "ws" / "prefect").exists()


@pytest.mark.slow
def test_the_dump_is_what_prefect_s_own_migrations_make():
    """Stale after a Prefect upgrade: `make generated` (python -m flows.prefect_schema) writes the new one."""
    assert statements(prefect_schema.migrated_dump()) == statements(prefect_schema.schema_file().read_text()), \
        "flows/prefect_schema is stale: run `python -m flows.prefect_schema` (make generated)"
