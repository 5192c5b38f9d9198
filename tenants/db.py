"""Database URLs, the async engine and running the migrations.

`DATABASE_URL` picks PostgreSQL (postgresql:// is mapped to asyncpg); without
it the embedded default is a SQLite file under the data directory.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

MIGRATIONS = Path(__file__).parent / "migrations"


def default_sqlite_url(data_dir: str | Path) -> str:
    """The embedded database: <data_dir>/sluice.db, creating the directory."""
    path = Path(data_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{path / 'sluice.db'}"


def async_url(url: str) -> str:
    """Map plain driver URLs to the async drivers we ship (asyncpg, aiosqlite)."""
    for plain, driver in (
        ("postgres://", "postgresql+asyncpg://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


def create_engine(url: str, sqlite_busy_timeout_s: float = 30.0) -> AsyncEngine:
    """The async engine of `url`; on SQLite a writer waits up to `sqlite_busy_timeout_s` for the
    file's write lock before failing with "database is locked"."""
    url = async_url(url)
    if make_url(url).get_backend_name() == "sqlite":
        # Several processes may share the file: WAL lets readers run beside the one writer, and
        # busy_timeout makes a writer wait for the lock instead of failing at once.
        busy_ms = int(sqlite_busy_timeout_s * 1000)
        engine = create_async_engine(url, connect_args={"timeout": sqlite_busy_timeout_s})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: object, _record: object) -> None:
            cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


def session_factory(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    return async_sessionmaker(engine, expire_on_commit=False)


def _alembic(connection: Connection, revision: str, up: bool) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    if up:
        command.upgrade(config, revision)
    else:
        command.downgrade(config, revision)


async def run_migrations(engine: AsyncEngine, revision: str = "head") -> None:
    """`alembic upgrade <revision>` on this engine's database."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Replicas starting together: one migrates, the others wait and then find it done.
            await conn.execute(text("SELECT pg_advisory_xact_lock(7355608)"))
        await conn.run_sync(_alembic, revision, True)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_alembic, revision, False)


async def create_postgres_database(url: str) -> None:
    """CREATE DATABASE for `url`'s database, connecting to the server's `postgres` database
    (provisioning a fresh tenant database: a new deployment, a test session)."""
    await _on_server(url, "CREATE DATABASE {}")


async def drop_postgres_database(url: str) -> None:
    await _on_server(url, "DROP DATABASE IF EXISTS {} WITH (FORCE)")


async def _on_server(url: str, statement: str) -> None:
    target = make_url(async_url(url))
    engine = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            quoted = conn.dialect.identifier_preparer.quote(target.database or "")
            await conn.execute(text(statement.format(quoted)))
    finally:
        await engine.dispose()
