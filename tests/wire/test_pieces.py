"""Output files cut into link-sized pieces, and put back together."""

from __future__ import annotations

import base64
import hashlib
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.wire.codec import MAX_MESSAGE_BYTES, encode
from llmgw.wire.pieces import PIECE_BYTES, file_digest, iter_pieces, piece_count


def test_a_piece_fits_a_link_message_with_room() -> None:
    assert PIECE_BYTES * 4 / 3 < MAX_MESSAGE_BYTES / 8


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([0, 1, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1, 2 * PIECE_BYTES + 7])
    | st.integers(0, 3 * PIECE_BYTES),
    st.integers(0, 255),
)
def test_pieces_reassemble_into_the_file_and_match_its_digest(tmp_path_factory, size: int, seed: int) -> None:
    data = bytes((seed + i * 7) % 256 for i in range(size))
    path = Path(tmp_path_factory.mktemp("p")) / "adapter_model.safetensors"
    path.write_bytes(data)
    digest = file_digest(path)
    assert (digest.name, digest.size, digest.sha256) == (path.name, size, hashlib.sha256(data).hexdigest())
    with open(path, "rb") as file:
        pieces = list(iter_pieces("job-1", path.name, file))
    assert len(pieces) == piece_count(size) == max(1, -(-size // PIECE_BYTES))
    whole = b""
    for index, piece in enumerate(pieces):
        chunk = base64.b64decode(piece.data)
        assert (piece.job_id, piece.file, piece.index, piece.count) == (
            "job-1",
            path.name,
            index,
            len(pieces),
        )
        assert piece.sha256 == hashlib.sha256(chunk).hexdigest() and len(chunk) <= PIECE_BYTES
        assert len(encode(piece)) < MAX_MESSAGE_BYTES
        whole += chunk
    assert whole == data


def test_pieces_are_read_one_at_a_time() -> None:
    with tempfile.TemporaryFile() as file:
        file.write(b"x" * (3 * PIECE_BYTES))
        pieces = iter_pieces("j", "f", file)
        first = next(pieces)
        assert first.count == 3 and file.tell() == PIECE_BYTES  # not the whole file at once
