"""Downloads against a real HTTP server on 127.0.0.1: resume, retries, verification, --from, mirrors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from fake_statmt import FakeStatmt
from nmt_cli.data.download import (
    Remote,
    Retries,
    download,
    from_folder,
    mirrored,
    read_checksums,
    with_checksums,
)
from nmt_cli.errors import NmtError

CONTENT = os.urandom(300_000)  # a few read chunks' worth, incompressible
PATH = "/wmt14/file.tgz"
FAST = Retries(attempts=4, timeout_seconds=5, wait_seconds=0.01)
SHORT_TIMEOUT = Retries(attempts=2, timeout_seconds=0.2, wait_seconds=0.01)  # a stall fails at once


def remote(url: str, **known: object) -> Remote:
    return Remote("file.tgz", url + PATH, origin="the test", **known)


@pytest.fixture
def site() -> FakeStatmt:
    with FakeStatmt({PATH: CONTENT}) as server:
        yield server


def test_a_cut_download_resumes_with_a_range_request(site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, "cut")
    path, record = download(remote(site.url, sha256=hashlib.sha256(CONTENT).hexdigest()), tmp_path, FAST)
    assert path.read_bytes() == CONTENT
    assert site.requests_for(PATH) == [None, f"bytes={len(CONTENT) // 2}-"]  # only the rest is asked for
    assert record["sha256"] == hashlib.sha256(CONTENT).hexdigest() and record["bytes"] == len(CONTENT)
    assert not (tmp_path / "file.tgz.part").exists()


def test_a_server_that_ignores_range_makes_the_download_start_over(site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, "cut", "ignore-range")
    path, _ = download(remote(site.url, bytes=len(CONTENT)), tmp_path, FAST)
    assert path.read_bytes() == CONTENT  # not the first half followed by the whole file
    assert len(site.requests_for(PATH)) == 2


def test_server_errors_and_dropped_connections_are_retried(site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, "500", "drop", "500")
    path, _ = download(remote(site.url), tmp_path, FAST)
    assert path.read_bytes() == CONTENT
    assert len(site.requests_for(PATH)) == 4


def test_a_stalled_server_times_out_and_is_tried_again(site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, "stall")
    path, _ = download(remote(site.url), tmp_path, SHORT_TIMEOUT)
    assert path.read_bytes() == CONTENT
    assert len(site.requests_for(PATH)) == 2


def test_giving_up_after_the_last_attempt_says_what_to_do(site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, *["500"] * 10)
    with pytest.raises(NmtError, match=r"after 4 attempts .*HTTP 500.*--from"):
        download(remote(site.url), tmp_path, FAST)
    assert len(site.requests_for(PATH)) == 4
    assert not (tmp_path / "file.tgz").exists()


def test_an_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    with FakeStatmt({}) as dead:
        url = dead.url  # the port is closed once the server stops
    with pytest.raises(NmtError, match="cannot connect"):
        download(remote(url), tmp_path, Retries(2, 2, 0.01))


def test_a_wrong_file_is_rejected_by_checksum_and_deleted(site: FakeStatmt, tmp_path: Path) -> None:
    expected = hashlib.sha256(CONTENT).hexdigest()
    site.fail(PATH, "wrong")
    with pytest.raises(NmtError) as error:
        download(remote(site.url, sha256=expected), tmp_path, FAST)
    message = str(error.value)
    assert "file.tgz" in message and expected in message and "run again" in message
    actual = message.split("got ")[1].split(";")[0]
    assert len(actual) == 64 and actual != expected
    assert list(tmp_path.iterdir()) == []  # neither the bad file nor its .part stays
    path, _ = download(remote(site.url, sha256=expected), tmp_path, FAST)  # the next run succeeds
    assert path.read_bytes() == CONTENT


def test_a_size_that_differs_from_the_published_one_is_refused_before_downloading(
        site: FakeStatmt, tmp_path: Path) -> None:
    with pytest.raises(NmtError, match=f"offers {len(CONTENT)} bytes but file.tgz has 12345"):
        download(remote(site.url, bytes=12345), tmp_path, FAST)
    assert not (tmp_path / "file.tgz").exists()


def test_a_missing_file_is_not_retried(site: FakeStatmt, tmp_path: Path) -> None:
    with pytest.raises(NmtError, match="HTTP 404"):
        download(Remote("nothing.tgz", site.url + "/nothing.tgz"), tmp_path, FAST)
    assert len(site.requests) == 1


def test_a_finished_download_is_reused_and_reverified(site: FakeStatmt, tmp_path: Path) -> None:
    download(remote(site.url), tmp_path, FAST)
    download(remote(site.url), tmp_path, FAST)
    assert len(site.requests) == 1
    with pytest.raises(NmtError, match="delete .*file.tgz and run again"):
        download(remote(site.url, md5="0" * 32), tmp_path, FAST)


def test_a_complete_part_left_by_a_crash_is_finished_without_downloading_again(
        site: FakeStatmt, tmp_path: Path) -> None:
    (tmp_path / "file.tgz.part").write_bytes(CONTENT)
    path, _ = download(remote(site.url), tmp_path, FAST)  # the server answers 416 to the range request
    assert path.read_bytes() == CONTENT
    assert site.requests_for(PATH) == [f"bytes={len(CONTENT)}-"]


def test_from_folder_names_every_missing_file_and_its_url(tmp_path: Path) -> None:
    (tmp_path / "a.tgz").write_bytes(b"x")
    remotes = [Remote("a.tgz", "http://statmt.org/a.tgz"), Remote("b.tgz", "http://statmt.org/wmt14/b.tgz"),
               Remote("c.tar", "http://statmt.org/c.tar")]
    with pytest.raises(NmtError, match=r"lacks 2 file\(s\): b.tgz \(http://statmt.org/wmt14/b.tgz\); c.tar"):
        from_folder(remotes, tmp_path)
    [(path, record)] = from_folder(remotes[:1], tmp_path)
    assert record["sha256"] == hashlib.sha256(b"x").hexdigest()
    assert record["verified"].startswith("no published")
    with pytest.raises(NmtError, match="replace it with a fresh copy from http://statmt.org/a.tgz"):
        from_folder([Remote("a.tgz", "http://statmt.org/a.tgz", bytes=2, origin="x")], tmp_path)


def test_mirror_replaces_the_statmt_hosts() -> None:
    for url in ("http://statmt.org/wmt14/dev.tgz", "https://www.statmt.org/wmt14/dev.tgz",
                "http://data.statmt.org/wmt14/dev.tgz"):
        assert mirrored(url, "http://127.0.0.1:8000/") == "http://127.0.0.1:8000/wmt14/dev.tgz"
    assert mirrored("http://statmt.org.evil/x", "http://m") == "http://statmt.org.evil/x"
    assert mirrored("http://statmt.org/x", None) == "http://statmt.org/x"


def test_checksums_file_adds_and_replaces_entries(tmp_path: Path) -> None:
    sums = tmp_path / "SUMS"
    sums.write_text(f"# comment\n{'a' * 64}  dir/file.tgz\n{'B' * 32} *other.tgz\n\n")
    table = read_checksums(sums)
    assert table == {"file.tgz": ("sha256", "a" * 64), "other.tgz": ("md5", "b" * 32)}
    built_in = Remote("file.tgz", "http://x/file.tgz", bytes=5, md5="c" * 32, origin="built in")
    replaced = with_checksums(built_in, table, str(sums))
    replacement = (replaced.sha256, replaced.md5, replaced.bytes, replaced.origin)
    assert replacement == ("a" * 64, None, None, str(sums))
    assert with_checksums(Remote("x.tgz", "u"), table, "f") == Remote("x.tgz", "u")
    sums.write_text("not-a-checksum  file.tgz\n")
    with pytest.raises(NmtError, match="SUMS, line 1: expected"):
        read_checksums(sums)


# ---------------------------------------------------------------------------------------------
# More faults: stalls inside the body, redirects, odd range answers, bodies of unknown length


def test_a_server_that_stalls_inside_the_file_times_out_and_the_rest_is_resumed(
        site: FakeStatmt, tmp_path: Path) -> None:
    site.fail(PATH, "stall-body")
    path, _ = download(remote(site.url), tmp_path, SHORT_TIMEOUT)
    assert path.read_bytes() == CONTENT
    assert site.requests_for(PATH) == [None, f"bytes={len(CONTENT) // 2}-"]


def test_a_redirect_is_followed_and_a_resumed_request_keeps_its_range(tmp_path: Path) -> None:
    with FakeStatmt({PATH: CONTENT}, redirects={"/old/file.tgz": PATH}) as server:
        server.fail(PATH, "cut")
        path, record = download(Remote("file.tgz", server.url + "/old/file.tgz"), tmp_path, FAST)
        assert path.read_bytes() == CONTENT and record["bytes"] == len(CONTENT)
        assert server.requests_for(PATH) == [None, f"bytes={len(CONTENT) // 2}-"]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_every_redirect_status_is_followed_with_its_range(tmp_path: Path, status: int) -> None:
    """308 too, which urllib follows by itself only from Python 3.11 on."""
    with FakeStatmt({PATH: CONTENT}, redirects={"/old/file.tgz": PATH}, redirect_status=status) as server:
        server.fail(PATH, "cut")
        path, _ = download(Remote("file.tgz", server.url + "/old/file.tgz"), tmp_path, FAST)
        assert path.read_bytes() == CONTENT
        assert server.requests_for("/old/file.tgz") == [None, f"bytes={len(CONTENT) // 2}-"]


def test_every_wmt14_archive_is_verified_by_a_published_checksum_or_size() -> None:
    from nmt_cli.data.wmt import ARCHIVES

    for remote in ARCHIVES.values():
        assert remote.sha256 or remote.md5 or remote.bytes, remote.name
        assert remote.origin, remote.name


def test_a_redirect_loop_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    with FakeStatmt({}, redirects={"/a.tgz": "/b.tgz", "/b.tgz": "/a.tgz"}) as server, \
            pytest.raises(NmtError, match=r"a.tgz: HTTP 30\d.*check the URL"):
        download(Remote("a.tgz", server.url + "/a.tgz"), tmp_path, FAST)
    assert list(tmp_path.iterdir()) == []


def test_a_range_answered_with_another_range_starts_over(site: FakeStatmt, tmp_path: Path) -> None:
    """Asking again would get the same wrong range: the part is dropped and the file fetched whole."""
    site.fail(PATH, "cut", "bad-range")
    path, _ = download(remote(site.url, sha256=hashlib.sha256(CONTENT).hexdigest()), tmp_path, FAST)
    assert path.read_bytes() == CONTENT
    assert site.requests_for(PATH) == [None, f"bytes={len(CONTENT) // 2}-", None]


def test_a_part_longer_than_the_file_starts_over(site: FakeStatmt, tmp_path: Path) -> None:
    (tmp_path / "file.tgz.part").write_bytes(CONTENT + b"tail of another file")
    path, _ = download(remote(site.url), tmp_path, FAST)
    assert path.read_bytes() == CONTENT
    assert site.requests_for(PATH) == [f"bytes={len(CONTENT) + 20}-", None]


def test_a_body_of_unknown_length_is_never_taken_as_complete(site: FakeStatmt, tmp_path: Path) -> None:
    """No Content-Length, the connection closes after half the file: without a size or checksum the
    download cannot be told from a cut one, so it stays a .part and the error says how to go on."""
    site.fail(PATH, "no-length")
    with pytest.raises(NmtError, match=r"did not say how long file.tgz is.*--checksums"):
        download(remote(site.url), tmp_path, FAST)
    assert [p.name for p in tmp_path.iterdir()] == ["file.tgz.part"]
    path, _ = download(remote(site.url, sha256=hashlib.sha256(CONTENT).hexdigest()), tmp_path, FAST)
    assert path.read_bytes() == CONTENT  # with the checksum the part is resumed and verified
    assert site.requests_for(PATH)[-1] == f"bytes={len(CONTENT) // 2}-"


@pytest.mark.parametrize("faults, known, attempts, message", [
    (["500"] * 4, {}, 4, "after 4 attempts"),
    (["404"], {}, 4, "HTTP 404"),
    (["drop"] * 4, {}, 4, "after 4 attempts"),
    (["stall-body"], {}, 1, "after 1 attempts"),
    (["cut"], {}, 1, "after 1 attempts"),  # fewer bytes than its Content-Length
    (["no-length"], {}, 4, "did not say how long"),
    (["no-length"], {"sha256": hashlib.sha256(CONTENT).hexdigest()}, 4, "does not match the known sha256"),
    (["wrong"], {"sha256": hashlib.sha256(CONTENT).hexdigest()}, 4, "does not match the known sha256"),
    (["cut"], {"bytes": len(CONTENT) + 1}, 4, "offers"),
])
def test_no_failed_download_leaves_a_file_that_a_later_from_run_accepts(
        site: FakeStatmt, tmp_path: Path, faults: list[str], known: dict, attempts: int,
        message: str) -> None:
    site.fail(PATH, *faults)
    downloads = tmp_path / "downloads"
    with pytest.raises(NmtError, match=message) as error:
        download(remote(site.url, **known), downloads,
                 Retries(attempts, timeout_seconds=0.2, wait_seconds=0.01))
    assert "file.tgz" in str(error.value)
    assert not (downloads / "file.tgz").exists()  # only a .part, whose name no run takes for an archive
    with pytest.raises(NmtError, match="lacks 1 file"):
        from_folder([remote(site.url, **known)], downloads)
