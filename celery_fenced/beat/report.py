"""``manage.py fenced beat``: who leads each fenced beat, and each entry's last tick."""

from __future__ import annotations

from typing import Any

from celery_fenced import store, terminal

HELP = "Show who leads each fenced beat (by the database's clock) and each entry's last tick."


def beat(io: terminal.IO, options: dict[str, Any]) -> None:
    """Write the leader of every beat key with entries (and ``--key``), and its entries."""
    alias = store.database_alias(options.get("database"))
    keys = set(store.beat_keys(alias)) | ({options["key"]} if options.get("key") else set())
    for key in sorted(keys):
        holder = store.beat_holder(alias, key)
        if holder is None:
            io.write(f"{key}: no leader")
        else:
            io.write(
                f"{key}: led by {holder.owner} (token {holder.token}, "
                f"{holder.remaining:.1f}s left)"
            )
        for entry in store.all_beat_entries(alias, key):
            tick = entry.last_tick.isoformat() if entry.last_tick else "-"
            io.write(f"  {entry.name}: last tick {tick}, {entry.sends} sent, token {entry.token}")
    if not keys:
        io.write("No fenced beat has sent a tick.")
