/* test_wire.c - frame header codec, stream parser, bounded reader, writer. */
#include <stdint.h>

#include "ember/wire.h"
#include "harness.h"

static void frame(uint8_t *out, uint16_t type, const void *payload, uint32_t len) {
  ember_wire_encode_header(out, type, len);
  if (len) memcpy(out + EMBER_WIRE_HEADER_LEN, payload, len);
}

TEST(error_names) {
  CHECK(strcmp(ember_err_name(EMBER_ETIMEDOUT), "EMBER_ETIMEDOUT") == 0);
  CHECK(strcmp(ember_strerror(EMBER_EAUTH), "authentication failed") == 0);
  CHECK(strcmp(ember_err_name(12345), "EMBER_UNKNOWN") == 0);
  CHECK(ember__set_error(EMBER_EIO, "x=%d", 7) == EMBER_EIO);
  CHECK(strcmp(ember_last_error(), "x=7") == 0);
  /* Prefixing the current message with itself must be safe. */
  ember__set_error(EMBER_EIO, "outer: %s", ember_last_error());
  CHECK(strcmp(ember_last_error(), "outer: x=7") == 0);
  CHECK(ember__set_errno(EMBER_ESYS, 2, "open %s", "f") == EMBER_ESYS);
  CHECK(strstr(ember_last_error(), "open f: ") == ember_last_error());
  ember_clear_error();
  CHECK(ember_last_error()[0] == '\0');
}

TEST(header_round_trip) {
  uint8_t h[EMBER_WIRE_HEADER_LEN];
  ember_frame_header fh;
  ember_wire_encode_header(h, EMBER_MSG_BATCH, 123456);
  CHECK(h[0] == 'E' && h[1] == 'M' && h[2] == 'B' && h[3] == 'R');
  CHECK_OK(ember_wire_decode_header(h, sizeof h, 1u << 20, &fh));
  CHECK_EQ_INT(fh.type, EMBER_MSG_BATCH);
  CHECK_EQ_INT(fh.length, 123456);
  CHECK_EQ_INT(fh.version, EMBER_WIRE_VERSION);
  CHECK_EQ_INT(ember_wire_decode_header(h, 11, 1u << 20, &fh), EMBER_EAGAIN);
  CHECK(strcmp(ember_wire_type_name(EMBER_MSG_BATCH), "BATCH") == 0);
  CHECK(strcmp(ember_wire_type_name(999), "UNKNOWN") == 0);
  CHECK(ember_wire_known_type(EMBER_MSG_STOP) && !ember_wire_known_type(0));
}

TEST(header_rejects) {
  uint8_t h[EMBER_WIRE_HEADER_LEN];
  ember_frame_header fh;
  ember_wire_encode_header(h, EMBER_MSG_AUTH, 64);
  h[0] = 'X';
  CHECK_EQ_INT(ember_wire_decode_header(h, sizeof h, 100, &fh), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "magic") != NULL);

  ember_wire_encode_header(h, EMBER_MSG_AUTH, 64);
  h[4] = 9;
  CHECK_EQ_INT(ember_wire_decode_header(h, sizeof h, 100, &fh), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "version 9") != NULL);

  ember_wire_encode_header(h, 77, 0);
  CHECK_EQ_INT(ember_wire_decode_header(h, sizeof h, 100, &fh), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "type 77") != NULL);

  ember_wire_encode_header(h, EMBER_MSG_BATCH, 101);
  CHECK_EQ_INT(ember_wire_decode_header(h, sizeof h, 100, &fh), EMBER_ETOOBIG);
  CHECK(strstr(ember_last_error(), "101") != NULL);
  /* The absolute cap applies whatever the caller's limit. */
  ember_wire_encode_header(h, EMBER_MSG_BATCH, EMBER_WIRE_ABSOLUTE_MAX + 1u);
  CHECK_EQ_INT(ember_wire_decode_header(h, sizeof h, UINT32_MAX, &fh), EMBER_ETOOBIG);
}

TEST(parser_byte_at_a_time) {
  uint8_t stream[3 * (EMBER_WIRE_HEADER_LEN + 5)];
  const char *words[3] = {"alpha", "", "gamma"};
  size_t n = 0;
  for (int i = 0; i < 3; i++) {
    uint32_t len = (uint32_t)strlen(words[i]);
    frame(stream + n, EMBER_MSG_REPORT, words[i], len);
    n += EMBER_WIRE_HEADER_LEN + len;
  }
  ember_wire_parser *p;
  CHECK_OK(ember_wire_parser_create(&p, 64));
  int got = 0;
  for (size_t i = 0; i < n; i++) {
    CHECK_OK(ember_wire_parser_feed(p, stream + i, 1));
    ember_frame_header h;
    const uint8_t *pl;
    int r;
    while ((r = ember_wire_parser_next(p, &h, &pl)) == 1) {
      CHECK(got < 3);
      CHECK_EQ_INT(h.type, EMBER_MSG_REPORT);
      CHECK_EQ_INT(h.length, strlen(words[got]));
      CHECK(memcmp(pl, words[got], h.length) == 0);
      got++;
    }
    CHECK_EQ_INT(r, 0);
  }
  CHECK_EQ_INT(got, 3);
  ember_wire_parser_destroy(p);
}

TEST(parser_many_frames_per_chunk) {
  enum { N = 500 };
  static uint8_t stream[N * (EMBER_WIRE_HEADER_LEN + 4)];
  size_t n = 0;
  for (uint32_t i = 0; i < N; i++) {
    uint8_t v[4];
    ember_wire_put_u32(v, i);
    frame(stream + n, EMBER_MSG_STOP, v, 4);
    n += EMBER_WIRE_HEADER_LEN + 4;
  }
  ember_wire_parser *p;
  CHECK_OK(ember_wire_parser_create(&p, 16));
  uint32_t expect = 0;
  /* Uneven chunks that split headers and payloads everywhere. */
  for (size_t off = 0, step = 1; off < n; off += step, step = step % 37 + 3) {
    size_t len = off + step > n ? n - off : step;
    CHECK_OK(ember_wire_parser_feed(p, stream + off, len));
    ember_frame_header h;
    const uint8_t *pl;
    while (ember_wire_parser_next(p, &h, &pl) == 1) {
      CHECK_EQ_INT(h.length, 4);
      CHECK_EQ_INT(ember_wire_get_u32(pl), expect);
      expect++;
    }
  }
  CHECK_EQ_INT(expect, N);
  /* One chunk with everything. */
  ember_wire_parser_destroy(p);
  CHECK_OK(ember_wire_parser_create(&p, 16));
  CHECK_OK(ember_wire_parser_feed(p, stream, n));
  ember_frame_header h;
  const uint8_t *pl;
  expect = 0;
  while (ember_wire_parser_next(p, &h, &pl) == 1) expect++;
  CHECK_EQ_INT(expect, N);
  ember_wire_parser_destroy(p);
}

TEST(parser_errors_sticky) {
  ember_wire_parser *p;
  uint8_t f[EMBER_WIRE_HEADER_LEN + 8];
  ember_frame_header h;
  const uint8_t *pl;
  CHECK_OK(ember_wire_parser_create(&p, 4));
  /* A valid frame, then one over the limit: the first is still delivered. */
  frame(f, EMBER_MSG_HEARTBEAT, NULL, 0);
  CHECK_OK(ember_wire_parser_feed(p, f, EMBER_WIRE_HEADER_LEN));
  ember_wire_encode_header(f, EMBER_MSG_BATCH, 5);
  /* Rejected as soon as the header is complete, before any payload. */
  CHECK_OK(ember_wire_parser_feed(p, f, 11));
  CHECK_EQ_INT(ember_wire_parser_next(p, &h, &pl), 1);
  CHECK_EQ_INT(h.type, EMBER_MSG_HEARTBEAT);
  CHECK_EQ_INT(ember_wire_parser_feed(p, f + 11, 1), EMBER_ETOOBIG);
  CHECK_EQ_INT(ember_wire_parser_next(p, &h, &pl), EMBER_ETOOBIG);
  frame(f, EMBER_MSG_HEARTBEAT, NULL, 0);
  CHECK_EQ_INT(ember_wire_parser_feed(p, f, EMBER_WIRE_HEADER_LEN), EMBER_ETOOBIG);
  ember_wire_parser_destroy(p);

  CHECK_OK(ember_wire_parser_create(&p, 4));
  CHECK_EQ_INT(ember_wire_parser_feed(p, (const uint8_t *)"GET / HTTP/1.1\r\n", 16),
               EMBER_EPROTO);
  ember_wire_parser_destroy(p);
  ember_wire_parser_destroy(NULL);
}

TEST(reader_bounds) {
  uint8_t buf[15];
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_u8(&w, 0xAB);
  ember_wire_write_u16(&w, 0xBEEF);
  ember_wire_write_u32(&w, 0xDEADBEEFu);
  ember_wire_write_u64(&w, 0x0102030405060708ull);
  CHECK_OK(w.err);
  CHECK_EQ_INT(w.len, 15);
  memcpy(buf, w.buf, 15);
  ember_wire_writer_free(&w);

  ember_wire_reader r;
  ember_wire_reader_init(&r, buf, sizeof buf);
  CHECK_EQ_INT(ember_wire_read_u8(&r), 0xAB);
  CHECK_EQ_INT(ember_wire_read_u16(&r), 0xBEEF);
  CHECK_EQ_INT(ember_wire_read_u32(&r), 0xDEADBEEFu);
  CHECK(ember_wire_read_u64(&r) == 0x0102030405060708ull);
  CHECK_OK(ember_wire_reader_finish(&r, 1, "test"));

  /* Truncation: the error is sticky and later reads return zeros. */
  ember_wire_reader_init(&r, buf, 5);
  CHECK_EQ_INT(ember_wire_read_u32(&r), ember_wire_get_u32(buf));
  CHECK_EQ_INT(ember_wire_read_u16(&r), 0);
  CHECK_EQ_INT(r.err, EMBER_EPROTO);
  CHECK_EQ_INT(ember_wire_read_u8(&r), 0);
  CHECK_EQ_INT(ember_wire_reader_finish(&r, 0, "thing"), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "thing") != NULL);

  /* Trailing bytes only matter with require_end. */
  ember_wire_reader_init(&r, buf, 3);
  ember_wire_read_u8(&r);
  CHECK_OK(ember_wire_reader_finish(&r, 0, "x"));
  CHECK_EQ_INT(ember_wire_reader_finish(&r, 1, "x"), EMBER_EPROTO);

  const uint8_t *raw = buf;
  ember_wire_reader_init(&r, buf, 4);
  ember_wire_read_raw(&r, &raw, 5);
  CHECK(raw == NULL && r.err == EMBER_EPROTO);
}

TEST(reader_strings) {
  ember_wire_writer w;
  ember_wire_reader r;
  char out[6];
  ember_wire_writer_init(&w);
  ember_wire_write_str(&w, "hello");
  ember_wire_write_str(&w, "");
  ember_wire_write_str(&w, "toolong");
  ember_wire_reader_init(&r, w.buf, w.len);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK(strcmp(out, "hello") == 0);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK(strcmp(out, "") == 0);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK_EQ_INT(r.err, EMBER_EPROTO);
  CHECK(out[0] == '\0');
  CHECK(strstr(ember_last_error(), "exceeds") != NULL);
  ember_wire_writer_free(&w);

  /* Embedded NUL. */
  uint8_t nul[8] = {4, 0, 0, 0, 'a', 0, 'b', 'c'};
  ember_wire_reader_init(&r, nul, sizeof nul);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK_EQ_INT(r.err, EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "NUL") != NULL);

  /* Claimed length beyond the buffer. */
  uint8_t lie[6] = {4, 0, 0, 0, 'a', 'b'};
  ember_wire_reader_init(&r, lie, sizeof lie);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK_EQ_INT(r.err, EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "truncated") != NULL);

  /* A huge claimed length is refused by the cap before anything else. */
  uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};
  ember_wire_reader_init(&r, huge, sizeof huge);
  ember_wire_read_str(&r, out, sizeof out);
  CHECK_EQ_INT(r.err, EMBER_EPROTO);
}

TEST(writer_grows) {
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  for (uint32_t i = 0; i < 100000; i++) ember_wire_write_u32(&w, i);
  CHECK_OK(w.err);
  CHECK_EQ_INT(w.len, 400000);
  CHECK_EQ_INT(ember_wire_get_u32(w.buf + 4 * 99999), 99999);
  ember_wire_write_raw(&w, NULL, 0);
  ember_wire_writer_free(&w);
  CHECK(w.buf == NULL && w.len == 0);
}

RUN_TESTS(T(error_names), T(header_round_trip), T(header_rejects),
          T(parser_byte_at_a_time), T(parser_many_frames_per_chunk),
          T(parser_errors_sticky), T(reader_bounds), T(reader_strings),
          T(writer_grows))
