#!/usr/bin/env python3
"""Writes the hand-made edge cases edge-*.bin of the safetensors header parser (replayed by the
ctest io/test_st_regressions next to the inputs fuzz/run.sh found). Run from this directory."""
import struct

def image(header, data=b"", hlen=None):
    h = header.encode("utf-8", "surrogateescape") if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data

T = '"dtype":"U8","shape":[%s],"data_offsets":[%s]'
cases = {
    "deep-nesting": image('{"a":' + "[" * 5000 + "]" * 5000 + "}"),
    "nul-in-names": image('{"a\\u0000b":{%s},"a\\u0000c":{%s}}' % (T % ("1", "0,1"), T % ("1", "1,2")), b"xy"),
    "huge-exponent": image('{"w":{%s}}' % (T % ("1e400", "0,0"))),
    "negative-zero": image('{"w":{%s}}' % (T % ("-0", "0,0"))),
    "above-2p53": image('{"w":{%s}}' % (T % ("9007199254740993", "0,0"))),
    "zero-len-at-end": image('{"w":{%s},"z":{%s}}' % (T % ("2", "0,2"), T % ("0", "2,2")), b"ab"),
    "zero-len-inside": image('{"w":{%s},"z":{%s}}' % (T % ("4", "0,4"), T % ("0", "2,2")), b"abcd"),
    "unterminated-string": image('{"w":{"dtype":"U8'),
    "bad-utf8-name": image(b'{"\xff\xfe":{' + (T % ("1", "0,1")).encode() + b"}}", b"x"),
    "metadata-null": image('{"__metadata__":null}'),
    "metadata-twice": image('{"__metadata__":{},"__metadata__":{}}'),
    "hlen-max": image("{}", hlen=0xFFFFFFFFFFFFFFFF),
    "hlen-zero": image("", hlen=0),
    "shape-not-array": image('{"w":{"dtype":"U8","shape":7,"data_offsets":[0,7]}}', b"x" * 7),
    "offsets-strings": image('{"w":{"dtype":"U8","shape":[1],"data_offsets":["0","1"]}}', b"x"),
    "trailing-nul": image('{}\x00\x00\x00\x00\x00\x00'),
    "space-padded": image('{}      '),
}
for name, data in cases.items():
    with open(f"edge-{name}.bin", "wb") as f:
        f.write(data)
print(f"wrote {len(cases)} files")
