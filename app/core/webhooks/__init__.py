"""Webhook events: written in the transaction of the change that causes them, and the rules
every attempt follows (docs/webhooks.md).

Owns: URL policy, signing, the retry schedule and bodies (``rules``); the outbox, events
inserted in a change's transaction and announced after its commit (``outbox``); a tenant's
webhook endpoints (``endpoints``). Sending an event again commits through
``app.core.lifecycle.changes`` and is therefore ``app.core.lifecycle.deliveries``'s. May
import: the rooms of the floor below (``contract``, ``messaging``, ``storage``, ``tenants``)
and the ground; nothing of ``processes``.
"""
