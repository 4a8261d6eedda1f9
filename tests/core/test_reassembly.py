"""A job's files in pieces: every violation is one error naming the piece; a complete, matching
sequence of pieces rebuilds each file byte for byte."""

from __future__ import annotations

import base64
import hashlib

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.reassembly import MAX_PIECE_BYTES, Reassembly, ReassemblyError, manifest_problems
from llmgw.core.training import FileDigest
from llmgw.wire.messages import JobPiece


def digest(name: str, data: bytes) -> FileDigest:
    return FileDigest(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def pieces(name: str, data: bytes, size: int, job_id: str = "j-1") -> list[JobPiece]:
    chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    return [
        JobPiece(
            job_id=job_id,
            file=name,
            index=i,
            count=len(chunks),
            data=base64.b64encode(chunk).decode(),
            sha256=hashlib.sha256(chunk).hexdigest(),
        )
        for i, chunk in enumerate(chunks)
    ]


@given(
    files=st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    size=st.integers(1, 64),
)
def test_pieces_in_order_rebuild_every_file(files: list[bytes], size: int):
    names = [f"f{i}.bin" for i in range(len(files))]
    upload = Reassembly(tuple(digest(n, d) for n, d in zip(names, files, strict=True)))
    rebuilt = {n: b"" for n in names}
    for name, data in zip(names, files, strict=True):
        assert not upload.done
        for piece in pieces(name, data, size):
            rebuilt[name] += upload.accept(piece)
    assert upload.done
    assert rebuilt == dict(zip(names, files, strict=True))
    assert upload.received_bytes == upload.total_bytes == sum(map(len, files))


DATA = b"0123456789" * 10
FILES = (digest("adapter_model.safetensors", DATA), digest("adapter_config.json", b"{}"))


def fresh() -> Reassembly:
    return Reassembly(FILES)


def first_pieces() -> list[JobPiece]:
    return pieces("adapter_model.safetensors", DATA, 40)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"file": "adapter_config.json"}, "expected a piece of adapter_model.safetensors"),
        ({"index": 1}, "expected piece 0"),
        ({"count": 0}, "count 0 does not hold index 0"),
        ({"data": "not base64!"}, "data is not base64"),
        ({"sha256": "0" * 64}, "sha256 of the piece does not match"),
    ],
)
def test_a_bad_first_piece_is_refused_naming_it(change: dict, message: str):
    piece = attrs.evolve(first_pieces()[0], **change)
    with pytest.raises(ReassemblyError, match=message):
        fresh().accept(piece)


def test_a_count_that_changes_is_refused():
    upload = fresh()
    first, second, _ = first_pieces()
    upload.accept(first)
    with pytest.raises(ReassemblyError, match="count changed from 3 to 4"):
        upload.accept(attrs.evolve(second, count=4))


def test_more_bytes_than_announced_are_refused():
    upload = Reassembly((digest("a.bin", b"abc"),))
    with pytest.raises(ReassemblyError, match="4 bytes, more than the announced 3"):
        upload.accept(pieces("a.bin", b"abcd", 10)[0])


def test_a_file_whose_digest_differs_is_refused_at_its_last_piece():
    announced = FileDigest(name="a.bin", size=3, sha256=hashlib.sha256(b"xyz").hexdigest())
    with pytest.raises(ReassemblyError, match="a.bin: sha256 of the file does not match"):
        Reassembly((announced,)).accept(pieces("a.bin", b"abc", 10)[0])


def test_a_file_that_ends_short_is_refused():
    with pytest.raises(ReassemblyError, match="ended at 3 bytes, announced 5"):
        Reassembly((FileDigest(name="a.bin", size=5, sha256="0" * 64),)).accept(
            pieces("a.bin", b"abc", 10)[0]
        )


def test_a_piece_after_the_end_is_refused():
    upload = Reassembly((digest("a.bin", b"abc"),))
    upload.accept(pieces("a.bin", b"abc", 10)[0])
    assert upload.done
    with pytest.raises(ReassemblyError, match="after every file was complete"):
        upload.accept(pieces("a.bin", b"abc", 10)[0])


def test_an_oversized_piece_is_refused():
    big = b"x" * (MAX_PIECE_BYTES + 1)
    upload = Reassembly((digest("a.bin", big),))
    with pytest.raises(ReassemblyError, match="larger than"):
        upload.accept(pieces("a.bin", big, len(big))[0])


def test_manifest_problems_name_each_file():
    assert manifest_problems(FILES) == []
    assert manifest_problems(()) == ["files: the upload lists no files"]
    bad = (
        FileDigest(name="../etc/passwd", size=1, sha256="0" * 64),
        FileDigest(name="a", size=-1, sha256="xyz"),
        FileDigest(name="a", size=1, sha256="0" * 64),
    )
    assert manifest_problems(bad) == [
        "files: '../etc/passwd' is not a bare file name",
        "files: a has a negative size -1",
        "files: a has no hex sha256 ('xyz')",
        "files: a listed twice",
    ]
    with pytest.raises(ReassemblyError, match="not a bare file name"):
        Reassembly(bad)
