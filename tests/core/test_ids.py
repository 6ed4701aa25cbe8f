"""``core/ids.py``: ids as ``secrets.token_hex`` gives them, never one handed out twice, not
even by a forked child that inherited the parent's unread random bytes."""

from __future__ import annotations

import os
import re

from core.ids import random_hex


def test_ids_are_hex_of_the_size_asked_and_all_distinct_across_blocks() -> None:
    ids = [random_hex() for _ in range(2_000)]  # about 8 blocks of 4 KiB
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"[0-9a-f]{10000}", random_hex(5_000))  # more than a block at once


def test_a_forked_child_never_hands_out_what_its_parent_will() -> None:
    random_hex()  # the parent holds a block with 255 ids unread
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out without pytest's teardown
        try:
            os.write(write_end, random_hex().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    parents_next = {random_hex() for _ in range(255)}
    assert re.fullmatch(r"[0-9a-f]{32}", child_id)
    assert child_id not in parents_next
