"""Django signals sent by celery-fenced.

Every signal is sent with ``sender`` the :class:`celery_fenced.models.Lease` model and
keyword arguments ``key``, ``token``, ``owner`` (and ``task_id`` where known):

- ``lease_acquired`` — a grant was issued (``reclaimed_from`` names the expired holder);
- ``lease_lost`` — a holder learned its grant is gone (``reason``);
- ``lease_released`` — a holder ended its grant (``forced`` is True for force_release);
- ``stale_write_rejected`` — a write under an old token was refused (``current``).
"""

from __future__ import annotations

from django.dispatch import Signal

lease_acquired = Signal()
lease_lost = Signal()
lease_released = Signal()
stale_write_rejected = Signal()
