"""The recording core: masks, logprobs, versions and segments of one episode (no sockets)."""

from __future__ import annotations

import pytest

from rollpool.protocol import codec
from rollpool.protocol import messages as m
from rollpool.workers.episodes.recording import EpisodeRecording, segment_id


def test_sampled_and_inserted_tokens_carry_mask_logprobs_and_versions() -> None:
    rec = EpisodeRecording("p", 2, start_version=7)
    seg, new = rec.continue_with([1, 2, 3])
    assert new and seg.input_ids == [1, 2, 3]
    rec.current.insert([40])  # before any sampled token: the start version
    seg.sample([10, 11], [-0.5, -0.25], [8, 9], "stop")
    seg.insert([50, 51])  # after: the version of the sampled token before
    seg.sample([12], [-1.0], [10], "length")
    (t,) = rec.trajectories()
    assert t.trajectory_id == "p:2" and t.segment_index == 0
    assert t.input_ids.tolist() == [1, 2, 3]
    assert t.output_ids.tolist() == [40, 10, 11, 50, 51, 12]
    assert t.loss_mask.tolist() == [0, 1, 1, 0, 0, 1]
    assert t.output_logprobs.tolist() == [0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert t.token_versions.tolist() == [7, 8, 9, 9, 9, 10]
    assert t.finish_reason == "length"


def test_a_prompt_that_extends_the_sequence_appends_only_the_new_tokens() -> None:
    rec = EpisodeRecording("p", 0, start_version=0)
    seg, _ = rec.continue_with([1, 2])
    seg.sample([3, 4], [-1.0, -1.0], [0, 0], "stop")
    seg2, new = rec.continue_with([1, 2, 3, 4, 5, 6])
    assert seg2 is seg and not new
    assert seg.output_ids == [3, 4, 5, 6] and seg.loss_mask == [1, 1, 0, 0]
    # the same sequence again inserts nothing
    assert rec.continue_with([1, 2, 3, 4, 5, 6]) == (seg, False)
    assert seg.output_ids == [3, 4, 5, 6]


def test_a_rewritten_history_opens_a_new_segment_with_its_own_id() -> None:
    rec = EpisodeRecording("p", 1, start_version=3)
    seg, _ = rec.continue_with([1, 2])
    seg.sample([3], [-1.0], [4], "stop")
    seg1, new = rec.continue_with([1, 9, 9])  # the agent edited its history
    assert new and seg1.index == 1 and seg1.input_ids == [1, 9, 9] and seg1.output_ids == []
    seg1.insert([5])  # nothing sampled in this segment yet: the episode's start version
    seg1.sample([6], [-2.0], [5], "stop")
    t0, t1 = rec.trajectories(reward=1.0, metadata={"k": "v"})
    assert (t0.trajectory_id, t1.trajectory_id) == ("p:1", "p:1:1")
    assert t1.token_versions.tolist() == [3, 5]
    assert t0.reward == t1.reward == 1.0 and t1.metadata == {"k": "v"}
    # a shorter prompt than the sequence is a rewrite too (a message dropped)
    _, new = rec.continue_with([1, 9])
    assert new and len(rec.segments) == 3


def test_segment_ids() -> None:
    assert segment_id("a", 0, 0) == "a:0"
    assert segment_id("a", 3, 2) == "a:3:2"
    with pytest.raises(ValueError):
        segment_id("a", 0, -1)


def test_an_episode_that_recorded_nothing_gives_one_empty_trajectory_with_its_reason() -> None:
    rec = EpisodeRecording("p", 0, start_version=2)
    (t,) = rec.trajectories(finish_reason="error", metadata={"episode_error": "boom"})
    assert t.output_ids.tolist() == [] and t.finish_reason == "error" and t.metadata["episode_error"] == "boom"


def test_a_finish_reason_given_overrides_the_last_segment_only() -> None:
    rec = EpisodeRecording("p", 0, start_version=0)
    seg, _ = rec.continue_with([1])
    seg.sample([2], [-1.0], [0], "stop")
    rec.continue_with([3])
    assert [t.finish_reason for t in rec.trajectories(finish_reason="length")] == ["stop", "length"]


def test_a_sampled_turn_needs_aligned_arrays() -> None:
    rec = EpisodeRecording("p", 0, start_version=0)
    seg, _ = rec.continue_with([1])
    with pytest.raises(ValueError, match="one logprob and one version"):
        seg.sample([2, 3], [-1.0], [0, 0], "stop")


def test_segment_index_travels_on_the_wire_and_defaults_to_zero() -> None:
    rec = EpisodeRecording("p", 0, start_version=0)
    rec.continue_with([1])
    rec.continue_with([2])
    t1 = rec.trajectories()[1]
    res = m.Result(task_id="t", prompt_id="p", trajectories=(t1,))
    back = codec.decode(codec.encode(res))
    assert isinstance(back, m.Result)
    assert back.trajectories[0].segment_index == 1 and back.trajectories[0].trajectory_id == "p:0:1"
    plain = m.Trajectory(prompt_id="q", sample_index=4, input_ids=t1.input_ids, output_ids=t1.output_ids,
                         output_logprobs=t1.output_logprobs, token_versions=t1.token_versions, loss_mask=t1.loss_mask,
                         finish_reason="stop")
    assert plain.segment_index == 0 and plain.trajectory_id == "q:4"


def test_a_trajectory_from_a_peer_without_segment_index_decodes_as_segment_0() -> None:
    import msgpack

    rec = EpisodeRecording("p", 3, start_version=0)
    rec.continue_with([1])
    rec.continue_with([2])
    frames = codec.encode(m.Result(task_id="t", prompt_id="p", trajectories=tuple(rec.trajectories())))
    major, minor, kind, fields = msgpack.unpackb(frames[0])
    assert "segment_index" not in fields["trajectories"][0]  # the default is not written: segment 0 is the old format
    assert fields["trajectories"][1]["segment_index"] == 1
    del fields["trajectories"][1]["segment_index"]  # what a peer of the previous minor version sends
    old = [msgpack.packb([major, minor, kind, fields], use_bin_type=True), *frames[1:]]
    back = codec.decode(old)
    assert [t.segment_index for t in back.trajectories] == [0, 0]
    assert [t.trajectory_id for t in back.trajectories] == ["p:3", "p:3"]


def test_image_placeholders_are_expanded_in_the_trajectory_and_a_sampled_image_token_is_kept_as_text() -> None:
    from rollpool.workers.episodes.recording import SegmentImage

    img = 99
    rec = EpisodeRecording("p", 0, start_version=1)
    seg, _ = rec.continue_with([5, img, 6])
    seg.image_token_id = img
    seg.images = [SegmentImage(b"a", "sha-a", (1, 2, 6), 3), SegmentImage(b"b", "sha-b", (1, 4, 2), 2)]
    seg.sample([10, img], [-0.5, -0.25], [2, 2], "stop")  # the model sampled the image token: text, not a placeholder
    seg.insert([7, img, 8])
    seg.sample([11, 12], [-1.0, -2.0], [3, 3], "stop")
    seg.constrained.append((5, 7))
    assert seg.model_len() == len(seg) + 3 and seg.model_tokens()[:5] == [5, img, img, img, 6]
    (t,) = rec.trajectories(metadata={"k": 1})
    assert t.input_ids.tolist() == [5, img, img, img, 6]
    assert t.output_ids.tolist() == [10, img, 7, img, img, 8, 11, 12]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    assert t.output_logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert t.token_versions.tolist() == [2, 2, 2, 2, 2, 2, 3, 3]
    assert t.metadata["constrained_tokens"] == [[6, 8]]  # the sampled span, moved past the expanded image
    assert t.image_sha256 == ("sha-a", "sha-b") and t.image_grid_thw.tolist() == [1, 2, 6, 1, 4, 2]
    assert t.metadata["episode_images"] == {"sha-a": b"a", "sha-b": b"b"} and t.metadata["k"] == 1
    # a refused turn's images go with it
    mark = rec.mark()
    seg.images.append(SegmentImage(b"c", "sha-c"))
    rec.rollback(mark)
    assert [im.sha256 for im in seg.images] == ["sha-a", "sha-b"]


def test_the_segments_token_array_is_its_sequence_after_every_append_rollback_and_growth() -> None:
    import random

    import numpy as np

    from rollpool.workers.engines.base import TokenIds

    rnd = random.Random(3)
    rec = EpisodeRecording("p", 0, start_version=0)
    seg, _ = rec.continue_with([rnd.randrange(1000) for _ in range(300)])
    held = []
    for turn in range(40):  # past the buffer's first 1024 ids, so it grows
        mark = rec.mark()
        seg.insert([rnd.randrange(1000) for _ in range(rnd.randrange(0, 30))])
        arr = seg.token_array()  # the turn's prompt, as the episode makes it
        assert arr.dtype == np.int64 and arr.tolist() == seg.tokens
        ids = [rnd.randrange(1000) for _ in range(rnd.randrange(1, 60))]
        seg.sample(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        if turn % 4 == 1:  # a refused turn: undone, then other tokens where it stood
            if turn % 8 == 1:
                seg.token_array()
            rec.rollback(mark)
            seg.insert([rnd.randrange(1000) for _ in range(rnd.randrange(1, 30))])
        arr = seg.token_array()
        assert arr.tolist() == seg.tokens and seg.token_bounds() == (min(seg.tokens), max(seg.tokens))
        held.append((arr, list(seg.tokens)))
        prompt = TokenIds(seg.input_ids, arr, seg.token_bounds(), more=seg.output_ids)
        assert prompt == seg.tokens and prompt.array is arr and prompt.bounds == (min(seg.tokens), max(seg.tokens))
    assert len(seg) > 1024
    assert all(arr.tolist() == tokens for arr, tokens in held)  # later turns and rollbacks leave each as it was
    with pytest.raises(ValueError, match="int64"):
        TokenIds([1, 2], np.array([1, 2], dtype=np.int32))


def test_trajectory_ids_from_the_segments_array_are_its_lists_and_an_id_past_int32_still_raises() -> None:
    import numpy as np

    rec = EpisodeRecording("p", 0, start_version=0)
    seg, _ = rec.continue_with([5, -3, 7])
    seg.token_array()
    seg.sample([8, 9], [-1.0, -1.0], [1, 1], "stop")
    seg.insert([2**31 - 1])  # appended after the last array: converted when the trajectory is made
    (t,) = rec.trajectories()
    assert t.input_ids.dtype == np.int32 and t.input_ids.tolist() == [5, -3, 7]
    assert t.output_ids.dtype == np.int32 and t.output_ids.tolist() == [8, 9, 2**31 - 1]
    seg.insert([2**31])
    with pytest.raises(OverflowError):
        rec.trajectories()
