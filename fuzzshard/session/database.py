"""The Hypothesis example database: a directory, or redis shared between runs.

A soak can run for hours; the redis server it shares examples through may not.
So a redis database also writes every change to a directory database (nothing
found is lost if redis goes), reads from redis while it answers, and on the
first connection error says so in one line and serves everything from the
directory from then on (no reconnect attempts that would slow every case).
"""
from __future__ import annotations

from collections.abc import Iterable

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

TIMEOUT = 3.0  # seconds: a redis that does not answer in this long counts as gone


def open_database(where: str, fallback_dir: str, progress) -> ExampleDatabase:
    """``where``: a directory, or ``redis://host:port/db`` (then ``fallback_dir``
    is written too and takes over if redis goes away; ``progress`` gets the one
    line that says so)."""
    if not where.startswith(("redis://", "rediss://")):
        return DirectoryBasedExampleDatabase(where)
    return RedisWithFallback(where, fallback_dir, progress)


class RedisWithFallback(ExampleDatabase):
    """Redis while it answers, plus a directory database that always gets every
    write and serves everything after redis's first connection error."""

    def __init__(self, url: str, fallback_dir: str, progress):
        super().__init__()
        try:
            import redis
        except ImportError:  # an extra, not a dependency: only a redis:// database needs it
            raise ImportError(f"a redis database ({url}) needs the redis package: pip install 'fuzzshard[redis]'") from None
        from hypothesis.extra.redis import RedisExampleDatabase
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.progress = url, progress
        self.directory = DirectoryBasedExampleDatabase(fallback_dir)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError, OSError)
        self.redis: ExampleDatabase | None = None
        try:
            # one quick retry (a stale pooled connection), no backoff: a dead server fails fast
            client = redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT,
                                          retry=Retry(NoBackoff(), 1))
            client.ping()
            self.redis = RedisExampleDatabase(client)
        except self._errors as e:
            self._say(f"fuzzshard: redis at {url} cannot be reached ({type(e).__name__}: {e}): "
                      f"using the directory database {fallback_dir}")

    def __repr__(self) -> str:
        return f"RedisWithFallback({self.url!r}, {str(self.directory.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RedisWithFallback) and (self.url, self.directory) == (other.url, other.directory)

    def _say(self, line: str) -> None:
        print(line, file=self.progress, flush=True)

    def _on_redis(self, call):
        """``call(redis_db)`` unless redis has gone; False once it has."""
        if self.redis is None:
            return False
        try:
            return call(self.redis)
        except self._errors as e:
            self.redis = None
            self._say(f"fuzzshard: redis at {self.url} went away ({type(e).__name__}: {e}): "
                      f"going on with the directory database {self.directory.path}")
            return False

    def fetch(self, key: bytes) -> Iterable[bytes]:
        values = self._on_redis(lambda db: list(db.fetch(key)))  # fetch is lazy: read it all inside the try
        yield from (self.directory.fetch(key) if values is False else values)

    def save(self, key: bytes, value: bytes) -> None:
        self.directory.save(key, value)
        self._on_redis(lambda db: db.save(key, value))
        self._broadcast_change(("save", (key, value)))

    def delete(self, key: bytes, value: bytes) -> None:
        self.directory.delete(key, value)
        self._on_redis(lambda db: db.delete(key, value))
        self._broadcast_change(("delete", (key, value)))

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.directory.move(src, dest, value)
        self._on_redis(lambda db: db.move(src, dest, value))
        if src != dest:
            self._broadcast_change(("delete", (src, value)))
        self._broadcast_change(("save", (dest, value)))

    # listeners hear this process's own changes (not other processes')
    def _start_listening(self) -> None:
        pass

    def _stop_listening(self) -> None:
        pass
