/* tests/c/harness.h - a tiny test runner in the libuv style: each test runs in
 * its own forked child with a timeout, so a crash or hang fails one test, not
 * the run.  A test file defines its tests with TEST(name) and lists them in
 * main via RUN_TESTS(...).  The last line printed is "N passed, N failed". */
#ifndef EMBER_TEST_HARNESS_H
#define EMBER_TEST_HARNESS_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ember/error.h"

#define TEST(name) static void test_##name(void)

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, \
              __LINE__, #cond, ember_last_error());                           \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                      \
  do {                                                                          \
    long long va_ = (long long)(a), vb_ = (long long)(b);                       \
    if (va_ != vb_) {                                                           \
      fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %lld, %s == %lld (last "   \
              "error: %s)\n", __FILE__, __LINE__, #a, va_, #b, vb_,             \
              ember_last_error());                                              \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#define CHECK_OK(expr) CHECK_EQ_INT((expr), 0)

/* LeakSanitizer checks at exit, but a forked test ends with _exit(): ask for
 * the check explicitly when the runtime is linked in (weak: absent without it). */
int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

typedef struct {
  const char *name;
  void (*fn)(void);
} ember_test_case;

#ifndef EMBER_TEST_TIMEOUT_S
#define EMBER_TEST_TIMEOUT_S 60
#endif

static inline int ember_test_run_all(const ember_test_case *cases, size_t n,
                                     int argc, char **argv) {
  int passed = 0, failed = 0;
  signal(SIGPIPE, SIG_IGN);
  for (size_t i = 0; i < n; i++) {
    if (argc > 1 && strstr(cases[i].name, argv[1]) == NULL) continue;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(EMBER_TEST_TIMEOUT_S);
      cases[i].fn();
      fflush(stdout);
      if (__lsan_do_recoverable_leak_check && __lsan_do_recoverable_leak_check()) _exit(1);
      _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      printf("ok   %s\n", cases[i].name);
      passed++;
    } else {
      if (WIFSIGNALED(status))
        printf("FAIL %s (signal %d%s)\n", cases[i].name, WTERMSIG(status),
               WTERMSIG(status) == SIGALRM ? ": timed out" : "");
      else
        printf("FAIL %s (exit %d)\n", cases[i].name, WEXITSTATUS(status));
      failed++;
    }
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

#define RUN_TESTS(...)                                                   \
  int main(int argc, char **argv) {                                      \
    static const ember_test_case cases_[] = {__VA_ARGS__};               \
    return ember_test_run_all(cases_, sizeof cases_ / sizeof cases_[0],  \
                              argc, argv);                               \
  }
#define T(name) {#name, test_##name}

#endif /* EMBER_TEST_HARNESS_H */
