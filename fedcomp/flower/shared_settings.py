"""Run settings sent once per client, both halves.

Every instruction needs the codec spec, the tensor policy, the app's task settings and,
with a compressed downlink, the downlink codec's spec (about 0.7 KB of JSON), and they
do not change during a run. The server sends them in full until a client's reply header
confirms it holds them (their digest); after that
an instruction carries only the digest. The client keeps them in ``Context.state`` and
puts them back into the instruction's config before anything reads it, so the rest of
the mod and the app see the same config either way. A client that lost them (a wiped
or restarted node) answers with an error and is sent them in full next time.
"""

from __future__ import annotations

import hashlib

from flwr.app import ConfigRecord, RecordDict

from fedcomp.keys import KEY_CODEC, KEY_DOWNLINK_CODEC, KEY_POLICY, KEY_SETTINGS, KEY_TASK

#: The config keys whose values travel once (absent ones are simply not sent).
SHARED_KEYS = (KEY_CODEC, KEY_POLICY, KEY_TASK, KEY_DOWNLINK_CODEC)
#: Context.state record holding the last settings the server sent this client.
RECORD_SETTINGS = "fedcomp.settings"


def settings_digest(values: dict[str, str]) -> str:
    """A digest of the shared values (keys sorted)."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(values):
        h.update(f"{key}={values[key]}\n".encode())
    return h.hexdigest()


# --- server half ---------------------------------------------------------------------


class SharedSettings:
    """The shared values, their digest, and which clients confirmed holding them."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)
        self.digest = settings_digest(self.values)
        self.held: set[int] = set()

    def fill(self, config: ConfigRecord, client: int, *, restores: bool) -> None:
        """Put the digest into ``config``, and all the values too unless the client
        holds them and its mod ``restores`` them on this kind of message."""
        config[KEY_SETTINGS] = self.digest
        if client in self.held and restores:
            return
        for key, value in self.values.items():
            config[key] = value

    def note_reply(self, client: int | None, header: ConfigRecord | None) -> None:
        """A reply header confirms the digest its client holds. The client states it
        only in its reply to settings sent in full; a reply without it changes nothing
        (a client that lost them answers the next digest-only instruction with an
        error: :meth:`forget`)."""
        if client is None or header is None or KEY_SETTINGS not in header:
            return
        if header.get(KEY_SETTINGS) == self.digest:
            self.held.add(client)
        else:
            self.held.discard(client)

    def forget(self, client: int) -> None:
        """An error reply: send the values in full next time."""
        self.held.discard(client)


# --- client half ---------------------------------------------------------------------


def restore(content: RecordDict, state: RecordDict) -> str | None:
    """Complete an instruction's config from the client's copy, or keep a full copy;
    return the digest now held (None: the instruction has no shared settings).

    Raises
    ------
    ValueError
        When the instruction names a digest this client does not hold.
    """
    config = next((c for c in content.config_records.values() if KEY_SETTINGS in c), None)
    if config is None:
        return None
    digest = str(config[KEY_SETTINGS])
    sent = {k: str(config[k]) for k in SHARED_KEYS if k in config}
    held = state.config_records.get(RECORD_SETTINGS)
    if sent:  # the server sends all of them or none
        state[RECORD_SETTINGS] = ConfigRecord({**sent, KEY_SETTINGS: digest})
        return digest
    if held is None or held.get(KEY_SETTINGS) != digest:
        raise ValueError(
            f"the instruction refers to run settings {digest} this node does not hold "
            "(wiped or restarted): they are sent in full next time"
        )
    for key in SHARED_KEYS:
        if key in held:
            config[key] = held[key]
    return digest


def held_task(content: RecordDict, state: RecordDict) -> str | None:
    """The task JSON an instruction means, whether it carries it or only its digest
    (for mods that run before the compression mod restores the config)."""
    config = next((c for c in content.config_records.values() if KEY_TASK in c), None)
    if config is not None:
        return str(config[KEY_TASK])
    config = next((c for c in content.config_records.values() if KEY_SETTINGS in c), None)
    held = state.config_records.get(RECORD_SETTINGS)
    if config is None or held is None or held.get(KEY_SETTINGS) != config[KEY_SETTINGS]:
        return None
    return str(held[KEY_TASK]) if KEY_TASK in held else None
