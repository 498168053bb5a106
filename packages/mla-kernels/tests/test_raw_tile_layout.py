"""The index math of the kernel that dequantizes FP8 in registers (csrc/raw_tile_layout.h),
compiled by the host's C++ compiler and checked against independent models: wgmma's register
fragment layout (PTX ISA, "Register Fragments" for wgmma .m64nNk16: the A operand and the
accumulator share it), the bytes the TMA engine lands in a raw tile under the 128-byte swizzle,
and the shared-memory banks of a load."""

import itertools
import json
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

CSRC = Path(__file__).parents[1] / "src" / "mla_kernels" / "csrc"
COMPILER = shutil.which("g++") or shutil.which("c++")

DRIVER = r"""
#include <cstdio>
#include "raw_tile_layout.h"
using namespace mla::raw_tile;
int main() {
  std::printf("{\"stage_bytes\": %d, \"chunk_bytes\": %d, \"rope_offset\": %d, \"scale_offset\": %d,",
              kStageBytes, kChunkBytes, kRopeOffset, kScaleOffset);
  std::printf("\"token_of\": [");
  for (int p = 0; p < 64; ++p) std::printf("%s%d", p ? "," : "", token_of(p));
  std::printf("], \"q_column\": [");
  for (int d = 0; d < 576; ++d) std::printf("%s%d", d ? "," : "", q_column(d));
  std::printf("], \"threads\": [");
  for (int warp = 0; warp < 4; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      const ThreadOffsets at(warp, lane);
      std::printf("%s{\"key_latent\": [", warp + lane ? "," : "");
      for (int h = 0; h < 2; ++h)
        for (int group = 0; group < 8; ++group) std::printf("%s%d", h + group ? "," : "", at.key_latent(h, group));
      std::printf("], \"key_rope\": [%d,%d,%d,%d], \"key_scales\": [%d,%d], \"value_latent\": [",
                  at.key_rope(0, 0), at.key_rope(0, 1), at.key_rope(1, 0), at.key_rope(1, 1),
                  at.key_scales(0), at.key_scales(1));
      for (int s = 0; s < 4; ++s)
        for (int k = 0; k < 4; ++k) std::printf("%s%d", s + k ? "," : "", at.value_latent(s, k));
      std::printf("], \"value_scale\": [");
      for (int s = 0; s < 4; ++s)
        for (int k = 0; k < 4; ++k) std::printf("%s%d", s + k ? "," : "", at.value_scale(s, k));
      std::printf("], \"value_channel\": [");
      for (int m = 0; m < 8; ++m)
        for (int i = 0; i < 2; ++i) std::printf("%s%d", m + i ? "," : "", value_channel(warp, lane / 4, m, i));
      std::printf("]}");
    }
  }
  std::printf("]}\n");
}
"""


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    if COMPILER is None:
        pytest.skip("no host C++ compiler (g++ or c++) to build the layout driver")
    folder = tmp_path_factory.mktemp("raw_tile_layout")
    (folder / "driver.cpp").write_text(DRIVER)
    binary = folder / "driver"
    subprocess.run(
        [COMPILER, "-std=c++17", f"-I{CSRC}", str(folder / "driver.cpp"), "-o", str(binary)],
        check=True,
        capture_output=True,
    )
    out = json.loads(subprocess.run([str(binary)], check=True, capture_output=True).stdout)
    for index, thread in enumerate(out["threads"]):
        thread["warp"], thread["lane"] = divmod(index, 32)
        thread["key_latent"] = [thread["key_latent"][:8], thread["key_latent"][8:]]
        thread["key_rope"] = [thread["key_rope"][:2], thread["key_rope"][2:]]
        for name in ("value_latent", "value_scale"):
            thread[name] = [thread[name][4 * s : 4 * s + 4] for s in range(4)]
        thread["value_channel"] = [thread["value_channel"][2 * m : 2 * m + 2] for m in range(8)]
    return out


def fragment(warp: int, lane: int, register: int, element: int) -> tuple[int, int]:
    """(row, column) of a 64 x 16 wgmma fragment's value in register `register` (0-3), half
    `element` (0-1), of thread (warp, lane): PTX ISA, wgmma .m64nNk16."""
    row = 16 * warp + lane // 4 + 8 * (register % 2)
    column = 2 * (lane % 4) + element + 8 * (register // 2)
    return row, column


def raw_tile_bytes() -> dict[int, tuple[str, int, int]]:
    """What each byte of a raw tile holds, as the TMA engine writes 64 tokens: ("latent", token,
    byte 0-511), ("rope", token, byte 0-127) or ("scale", token, byte 0-15). The latent values
    land in four chunks of 64 rows x 128 bytes, the rope in one more, with the 128-byte swizzle
    (the 16-byte piece p of row r at p ^ (r % 8)); the scales follow, 16 bytes a token."""
    where = {}
    for token, byte in itertools.product(range(64), range(512 + 128)):
        chunk, column = divmod(byte, 128)
        offset = chunk * 8192 + token * 128 + ((column // 16) ^ (token % 8)) * 16 + column % 16
        where[offset] = ("latent", token, byte) if byte < 512 else ("rope", token, byte - 512)
    for token, byte in itertools.product(range(64), range(16)):
        where[5 * 8192 + token * 16 + byte] = ("scale", token, byte)
    return where


WHERE = raw_tile_bytes()


def test_the_stage_is_the_tokens_bytes_each_once(layout):
    assert len(WHERE) == 64 * 656 == layout["stage_bytes"]
    assert sorted(WHERE) == list(range(layout["stage_bytes"]))
    assert layout["stage_bytes"] % 1024 == 0
    assert (layout["chunk_bytes"], layout["rope_offset"], layout["scale_offset"]) == (
        8192,
        32768,
        40960,
    )


def test_key_fragments_are_k_rows_by_q_columns(layout):
    """S^T = K Q^T: row r of the A operand is one token, token_of(r); column c is one dim d with
    q_column(d) = c (where Q's dim d lies); every (token, dim) is read exactly once."""
    token_of, q_column = layout["token_of"], layout["q_column"]
    seen = defaultdict(int)
    for thread in layout["threads"]:
        for half, byte in itertools.product(range(2), range(16)):
            # 16 latent bytes for k-steps 4 group + byte // 4; rope: 8 bf16 for k-steps 32 + 2 piece
            loads = [
                (4 * group + byte // 4, thread["key_latent"][half][group]) for group in range(8)
            ]
            loads += [
                (32 + 2 * piece + byte // 8, thread["key_rope"][half][piece]) for piece in range(2)
            ]
            for step, offset in loads:
                kind, token, stored = WHERE[offset + byte]
                rope = kind == "rope"
                upper = (byte // 4 % 2) if rope else (byte % 4 // 2)
                element = byte // 2 % 2 if rope else byte % 2
                row, column = fragment(thread["warp"], thread["lane"], half + 2 * upper, element)
                dim = 512 + stored // 2 if rope else stored
                assert kind in ("latent", "rope") and token == token_of[row]
                assert q_column[dim] == 16 * step + column
                seen[token, dim] += not rope or stored % 2 == 0  # a rope value is two bytes
    assert sorted(seen) == list(itertools.product(range(64), range(576)))
    assert set(seen.values()) == {1}


def test_key_scales_are_the_rows_tokens(layout):
    for thread in layout["threads"]:
        for half in range(2):
            row, _ = fragment(thread["warp"], thread["lane"], half, 0)
            for group in range(4):
                kind, token, byte = WHERE[thread["key_scales"][half] + 4 * group]
                assert (kind, token, byte) == ("scale", layout["token_of"][row], 4 * group)


def test_value_fragments_are_channels_by_p_columns(layout):
    """O^T += V^T P^T: column c of the A operand is token token_of(c), as P^T's column c (S^T's
    row c); row r of tile m is the channel value_channel says; every (token, channel) once."""
    token_of = layout["token_of"]
    seen = defaultdict(int)
    for thread in layout["threads"]:
        warp, lane = thread["warp"], thread["lane"]
        for step, k, byte in itertools.product(range(4), range(4), range(16)):
            kind, token, channel = WHERE[thread["value_latent"][step][k] + byte]
            tile = byte // 8 * 4 + byte % 8 // 2
            register, element = 2 * (k // 2) + byte % 2, k % 2
            row, column = fragment(warp, lane, register, element)
            assert kind == "latent" and token == token_of[16 * step + column]
            assert channel == thread["value_channel"][tile][row // 8 % 2]
            seen[token, channel] += 1
            scale = WHERE[thread["value_scale"][step][k]]
            assert scale == ("scale", token, 4 * (channel // 128))
    assert sorted(seen) == list(itertools.product(range(64), range(512)))
    assert set(seen.values()) == {1}


def test_a_threads_channels_are_16_contiguous_of_its_own(layout):
    firsts = []
    for thread in layout["threads"]:
        channels = [c for tile in thread["value_channel"] for c in tile]
        assert channels == list(range(channels[0], channels[0] + 16)) and channels[0] % 16 == 0
        firsts.append(channels[0])
    assert sorted(set(firsts)) == list(range(0, 512, 16))  # lanes of a g share their channels


def test_q_columns_keep_dim_pairs_together(layout):
    q_column = layout["q_column"]
    assert sorted(q_column) == list(range(576))
    assert all(
        q_column[d] % 2 == 0 and q_column[d + 1] == q_column[d] + 1 for d in range(0, 576, 2)
    )


def conflicts(offsets: list[int], width: int) -> int:
    """Extra shared-memory wavefronts of one warp-wide load of `width` bytes per lane at these
    offsets: 16-byte loads are served a quarter warp at a time, 8-byte ones half a warp, 4-byte
    ones whole; within one, lanes that read different words of one bank conflict."""
    lanes_per_phase = 128 // width
    extra = 0
    for start in range(0, 32, lanes_per_phase):
        words = {
            o // 4 + i for o in offsets[start : start + lanes_per_phase] for i in range(width // 4)
        }
        per_bank = defaultdict(int)
        for word in words:
            per_bank[word % 32] += 1
        extra += max(per_bank.values()) - 1
    return extra


def test_every_load_is_free_of_bank_conflicts(layout):
    loads = []  # (offsets of the 32 lanes, width) for each load instruction of each warp
    for warp in range(4):
        threads = layout["threads"][32 * warp : 32 * warp + 32]
        for half in range(2):
            loads += [([t["key_latent"][half][g] for t in threads], 16) for g in range(8)]
            loads += [([t["key_rope"][half][p] for t in threads], 16) for p in range(2)]
            loads.append(([t["key_scales"][half] for t in threads], 16))
        for step, k in itertools.product(range(4), range(4)):
            loads.append(([t["value_latent"][step][k] for t in threads], 16))
            loads.append(([t["value_scale"][step][k] for t in threads], 4))
    assert [conflicts(offsets, width) for offsets, width in loads] == [0] * len(loads)


def test_the_conflict_model_sees_conflicts():
    assert conflicts([128 * lane for lane in range(32)], 16) == 4 * 7  # one column of 128-byte rows
    assert conflicts([16 * lane for lane in range(32)], 16) == 0
    assert conflicts([0] * 32, 4) == 0  # a broadcast
