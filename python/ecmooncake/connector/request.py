"""What the connector reads from one of vLLM's requests: the consumer an
encoder request names, the transfer id of each of its items, and where
each item stands in the prompt."""

from __future__ import annotations

from typing import Any


def consumer_address(params: Any) -> str | None:
    """The consumer control endpoint an encoder request names, if any.

    The in-tree connector's proxies send ``consumer_zmq``; ours ``consumer``.
    """
    if not isinstance(params, dict):
        return None
    raw = params.get("consumer") or params.get("consumer_zmq")
    if not isinstance(raw, str) or not raw:
        return None
    return raw if "://" in raw else "tcp://" + raw


def item_entries(request: Any) -> list[dict[str, Any] | None]:
    """The ``ec_transfer_params`` entry of each multimodal item of a
    request that names a transfer id, or None.

    ``ec_transfer_params["ec_items"][i]`` belongs to item i when it names no
    mm_hash or the item's own; otherwise the entry naming the item's mm_hash
    does. Proxies that merge the encoder's ``request_finished`` answer into
    the params put it under the item's identifier, which is accepted too.
    """
    params = getattr(request, "ec_transfer_params", None)
    features = getattr(request, "mm_features", None) or []
    if not isinstance(params, dict):
        return [None] * len(features)
    items = params.get("ec_items")
    items = [it for it in items if isinstance(it, dict)] if isinstance(items, list) else []
    by_hash = {str(it["mm_hash"]): it for it in items if it.get("mm_hash") and it.get("transfer_id")}
    out: list[dict[str, Any] | None] = []
    for index, feature in enumerate(features):
        ident = feature.identifier
        entry = None
        if index < len(items):
            it = items[index]
            if it.get("mm_hash") in (None, "", ident) and it.get("transfer_id"):
                entry = it
        if entry is None:
            entry = by_hash.get(ident)
        if entry is None and isinstance(params.get(ident), dict) and params[ident].get("transfer_id"):
            entry = params[ident]
        out.append(entry)
    return out


def transfer_ids(request: Any) -> list[str | None]:
    """The transfer id of each multimodal item of a request, or None
    (see :func:`item_entries`)."""
    return [str(e["transfer_id"]) if e is not None else None for e in item_entries(request)]


# What an ec_items entry says of an item the PD gets from Mooncake Store
# itself: no encoder pushes it (the proxy's store_reuse).
SOURCE_STORE = "store"


def from_store(request: Any) -> list[bool]:
    """Whether each multimodal item of a request comes from the Store: its
    entry names a transfer id and ``"source": "store"``."""
    return [e is not None and e.get("source") == SOURCE_STORE for e in item_entries(request)]


def num_embeds_of(request: Any, index: int) -> int:
    """How many encoder embeddings item ``index`` of a request takes."""
    # Older vLLM releases name it get_num_encoder_tokens.
    if hasattr(request, "get_num_encoder_embeds"):
        return int(request.get_num_encoder_embeds(index))
    return int(request.get_num_encoder_tokens(index))


def unconsumed(request: Any, index: int, num_computed_tokens: int) -> bool:
    """Whether the prompt still has positions of item ``index`` to compute."""
    pos = request.mm_features[index].mm_position
    return pos.offset + pos.length > num_computed_tokens
