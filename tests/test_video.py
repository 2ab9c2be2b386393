"""Video outputs: an MP4 (or WebM) and the PNG of its first frame, written whole or not at all."""

import errno
import os

import av
import numpy as np
import pytest
import torch
from PIL import Image

from cocodiff.errors import UsageError
from cocodiff.output.files import check_video, save_videos
from cocodiff.output.video import (
    Audio,
    as_frames,
    count_frames,
    read_audio,
    read_frames,
    still_path,
    video_bytes,
    write_video,
)

# Codec tolerance, in 8-bit levels: yuv420p keeps colour at half resolution (a sharp colour edge
# bleeds into its neighbour) and H.264 at CRF 18 / VP9 at CRF 30 quantize. Measured on `_frames`:
# max 30 (MP4) and 48 (WebM); the mean of a frame at most 3.1 (MP4), 3.6 (WebM), 4.0 (MP4 of
# 33x31 frames). The mean of each frame is what tells a frame in its place from a moved one: the
# same decoded frames 2 pixels off give at least 6.0, one frame late or early at least 9.6.
MAX_LEVELS = {".mp4": 40, ".webm": 64}
MEAN_LEVELS = 5.0
"""Bound on each frame's mean error."""


def _frame_means(decoded: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) decoded and true 8-bit frames -> the mean error of each frame, in levels."""
    return np.abs(decoded.astype(int) - truth.astype(int)).reshape(len(decoded), -1).mean(axis=1)


def _assert_close(decoded: np.ndarray, truth: np.ndarray, extension: str = ".mp4") -> None:
    """Every decoded frame is its true frame, within the codec's tolerance."""
    error = np.abs(decoded.astype(int) - truth.astype(int))
    means = _frame_means(decoded, truth)
    assert error.max() <= MAX_LEVELS[extension] and means.max() <= MEAN_LEVELS, (error.max(), means.round(2))


def _frames(count: int = 9, height: int = 48, width: int = 64) -> np.ndarray:
    """(F, H, W, 3) floats in [0, 1]: smooth colour ramps moving a little each frame."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([
        np.stack([(x + 4 * t) / (width + 4 * count), y / height, 0.5 + 0.4 * np.sin((x + y + 3 * t) / 9)], axis=-1)
        for t in range(count)
    ]).astype(np.float32)


@pytest.mark.parametrize("extension", [".mp4", ".webm"])
def test_nine_frames_make_a_video_of_nine_frames(tmp_path, extension):
    frames = _frames()
    path = tmp_path / f"clip{extension}"
    assert write_video(frames, path, fps=16) == tmp_path / "clip.png"
    assert count_frames(path) == 9
    decoded = read_frames(path).astype(int)  # (9, 48, 64, 3)
    assert decoded.shape == (9, 48, 64, 3)
    truth = as_frames(frames)
    _assert_close(decoded, truth, extension)
    # The bound tells frames moved 2 pixels (either way, either axis) or one frame late or early.
    for moved, place in [(decoded[:, :, 2:], truth[:, :, :-2]), (decoded[:, :, :-2], truth[:, :, 2:]),
                         (decoded[:, 2:], truth[:, :-2]), (decoded[:, :-2], truth[:, 2:]),
                         (decoded[1:], truth[:-1]), (decoded[:-1], truth[1:])]:
        assert _frame_means(moved, place).min() > MEAN_LEVELS
    repeated = decoded.copy()
    repeated[4] = decoded[3]  # one frame shown twice, the next one lost
    with pytest.raises(AssertionError):
        _assert_close(repeated, truth, extension)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 16 and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.codec_context.name == {".mp4": "h264", ".webm": "vp9"}[extension]
    assert {p.name for p in tmp_path.iterdir()} == {"clip.png", f"clip{extension}"}  # no temporary file left


def test_the_png_is_frame_0_exactly_and_the_video_starts_with_it(tmp_path):
    frames = _frames()
    write_video(frames, tmp_path / "clip.mp4")
    still = np.asarray(Image.open(tmp_path / "clip.png"))
    assert np.array_equal(still, (frames[0] * 255).round().astype(np.uint8))  # as save_images writes an image
    first = read_frames(tmp_path / "clip.mp4")[:2]
    _assert_close(first[:1], still[None])
    assert _frame_means(first[1:], still[None]).max() > MEAN_LEVELS  # not the second frame


def test_odd_sides_are_padded_in_the_video_and_kept_in_the_png(tmp_path):
    frames = _frames(count=3, height=33, width=31)
    write_video(frames, tmp_path / "odd.mp4")
    decoded = read_frames(tmp_path / "odd.mp4")
    assert decoded.shape == (3, 34, 32, 3) and count_frames(tmp_path / "odd.mp4") == 3
    _assert_close(decoded[:, :33, :31], as_frames(frames))  # the frames are not moved or scaled
    pad_error = np.abs(decoded[:, 33].astype(int) - decoded[:, 32])  # the padded row repeats the last one
    assert pad_error.mean() <= MEAN_LEVELS
    assert np.asarray(Image.open(tmp_path / "odd.png")).shape == (33, 31, 3)


def _inputs():
    frames = _frames(count=3)
    as_uint8 = (frames * 255).round().astype(np.uint8)
    return {
        "numpy float": frames,
        "numpy uint8": as_uint8,
        "torch (F, H, W, 3)": torch.from_numpy(frames),
        "torch (F, 3, H, W)": torch.from_numpy(frames).permute(0, 3, 1, 2),
        "PIL images": [Image.fromarray(frame) for frame in as_uint8],
        "list of arrays": list(frames),
    }


@pytest.mark.parametrize("kind", list(_inputs()))
def test_every_kind_of_frames_gives_the_same_png(tmp_path, kind):
    write_video(_inputs()[kind], tmp_path / "clip.mp4")
    assert count_frames(tmp_path / "clip.mp4") == 3
    expected = (_frames(count=3)[0] * 255).round().astype(np.uint8)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "clip.png")), expected)


@pytest.mark.parametrize("frames, message", [
    (np.zeros((2, 3, 8, 8, 3)), r"shape \(2, 3, 8, 8, 3\): expected one video"),
    (np.zeros((0, 8, 8, 3)), "no pixels"),
    ([], "no frames"),
])
def test_frames_of_the_wrong_shape_are_refused(tmp_path, frames, message):
    with pytest.raises(ValueError, match=message):
        write_video(frames, tmp_path / "clip.mp4")
    assert list(tmp_path.iterdir()) == []


def test_a_name_without_a_video_extension_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'\.avi' names no video format; use one of \.mp4, \.webm"):
        write_video(_frames(count=2), tmp_path / "clip.avi")
    with pytest.raises(ValueError, match="fps 0 is out of range"):
        write_video(_frames(count=2), tmp_path / "clip.mp4", fps=0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, message", [
    ("x.png", "--out {t}/x.png: the model makes videos and '.png' names no video format; end the name with .mp4 or .webm"),
    ("x", "--out {t}/x: the model makes videos and no extension names its format; end the name with .mp4 or .webm"),
    ("file/x.mp4", "--out {t}/file/x.mp4: {t}/file is a file, not a folder"),
    ("taken.mp4", "--out {t}/taken.png is a folder; give a file name"),  # where the first frame's PNG goes
])
def test_check_video_is_one_line_naming_the_path(tmp_path, name, message):
    (tmp_path / "file").write_text("")
    (tmp_path / "taken.png").mkdir()
    with pytest.raises(UsageError) as raised:
        check_video("--out", tmp_path / name)
    assert str(raised.value) == message.format(t=tmp_path)


def test_check_video_accepts_a_video_name_in_any_case(tmp_path):
    check_video("--out", tmp_path / "new" / "clip.MP4")
    check_video("--out", tmp_path / "clip.webm")
    check_video("--out", None)
    assert list(tmp_path.iterdir()) == []  # checking creates nothing


class _DiskFillsUp:
    """Stands in for `av.open`: the containers it opens write their first `room` packets (and the
    header before them), then every packet fails as it would on a full disk."""

    def __init__(self, room: int) -> None:
        self.room, self.written, self.real = room, 0, av.open

    def __call__(self, *args, **kwargs):
        return _FillingContainer(self.real(*args, **kwargs), self)


class _FillingContainer:
    def __init__(self, container, disk: _DiskFillsUp) -> None:
        self.container, self.disk = container, disk

    def mux(self, packets) -> None:
        for packet in packets if isinstance(packets, list) else [packets]:
            if self.disk.written >= self.disk.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.container.mux(packet)
            self.disk.written += 1

    def __getattr__(self, name):
        return getattr(self.container, name)


def test_a_write_that_fails_midway_leaves_the_old_video_whole_and_nothing_else(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    write_video(_frames(), path)
    old_video, old_still = path.read_bytes(), still_path(path).read_bytes()
    disk = _DiskFillsUp(room=4)
    monkeypatch.setattr(av, "open", disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_video(1 - _frames(), path)  # different frames: a new file would differ
    assert disk.written == 4  # it failed in the middle, with a header and frames already written
    assert path.read_bytes() == old_video and still_path(path).read_bytes() == old_still
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "clip.png"]


def test_a_video_that_cannot_be_written_at_the_end_is_kept_elsewhere(tmp_path):
    (tmp_path / "gone").write_text("")  # the folder became a file during the run
    videos = np.stack([_frames(count=2), _frames(count=2)])  # a pipeline's .frames: (B, F, H, W, 3)
    paths = [tmp_path / "ok.mp4", tmp_path / "gone" / "x.mp4"]
    written, problem = save_videos("--out", paths, videos, fps=16)
    try:
        assert written[0] == paths[0] and count_frames(paths[0]) == 2 and still_path(paths[0]).exists()
        assert written[1] != paths[1] and written[1].name == "x.mp4" and count_frames(written[1]) == 2
        assert still_path(written[1]).exists()
        assert problem.startswith(f"--out {paths[1]} could not be written (")
        assert problem.endswith(f"; kept at {written[1]})") and "\n" not in problem
    finally:
        for file in written[1].parent.iterdir():
            file.unlink()
        written[1].parent.rmdir()


def test_a_video_that_cannot_be_written_anywhere_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(av, "open", _DiskFillsUp(room=0))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    written, problem = save_videos("--out", [tmp_path / "x.mp4"], [_frames(count=2)], fps=16)
    assert written == [tmp_path / "x.mp4"]
    assert problem == f"--out {tmp_path / 'x.mp4'} could not be written (No space left on device; not kept elsewhere either)"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["temporary"]  # no half file, no empty folder


def test_video_bytes_is_the_file_write_video_writes(tmp_path):
    frames = _frames(count=4)
    data = video_bytes(frames, fps=16)
    write_video(frames, tmp_path / "clip.mp4", fps=16)
    assert data[4:8] == b"ftyp" and data == (tmp_path / "clip.mp4").read_bytes()


@pytest.mark.parametrize(("extension", "rate"), [(".mp4", 24000), (".webm", 48000)])
def test_a_soundtrack_is_written_beside_the_frames(tmp_path, extension, rate):
    """Stereo audio at 24 kHz (LTX-2's vocoder's) is the video's second stream, AAC in MP4 and Opus
    (resampled to 48 kHz) in WebM: each channel's tone comes back in its place, the frames unchanged,
    and the bytes in memory are the file's."""
    t = np.arange(9600) / 24000  # 0.4 s: as long as 9 frames at 24 fps
    tones = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    frames = _frames()
    path = write_video(frames, tmp_path / f"clip{extension}", fps=24, audio=Audio(tones, 24000)).with_suffix(extension)
    _assert_close(read_frames(path), as_frames(frames), extension)
    sound = read_audio(path)
    assert sound.rate == rate and sound.samples.shape[0] == 2 and sound.samples.shape[1] >= 0.4 * rate
    for channel, hertz in ((0, 440), (1, 660)):  # each channel's strongest frequency, within 5 Hz
        spectrum = np.abs(np.fft.rfft(sound.samples[channel]))
        assert abs(np.argmax(spectrum) * rate / len(sound.samples[channel]) - hertz) < 5
    assert 0.4 < np.abs(sound.samples[1]).max() / np.abs(sound.samples[0]).max() < 0.6
    assert read_audio(write_video(frames, tmp_path / f"mute{extension}", fps=24).with_suffix(extension)) is None
    if extension == ".mp4":
        assert video_bytes(frames, fps=24, audio=Audio(tones, 24000)) == path.read_bytes()


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_a_pipeline_result_gives_one_mp4_per_video(tmp_path, output_type):
    from types import SimpleNamespace

    from cocodiff.serve.calls import mp4s

    batch = np.stack([_frames(count=3), 1 - _frames(count=3)])  # (B, F, H, W, 3), as WanPipeline's .frames
    frames = batch if output_type == "np" else [[Image.fromarray(f) for f in as_frames(v)] for v in batch]
    answers = mp4s(SimpleNamespace(frames=frames), fps=16)
    assert len(answers) == 2
    for i, data in enumerate(answers):
        (tmp_path / f"{i}.mp4").write_bytes(data)
        decoded = read_frames(tmp_path / f"{i}.mp4").astype(int)
        assert decoded.shape == (3, 48, 64, 3)
        _assert_close(decoded, as_frames(batch[i]))  # video i is video i, not the other
