/*
 * A stand-in libcuda.so.1 for tests: the driver's checkpoint API, with state.
 *
 * kiwid's CUDA lock adapter (kiwid/adapters/cudalock.py) loads libcuda.so.1 with
 * ctypes; built as DIR/libcuda.so.1 and found through LD_LIBRARY_PATH, this file
 * answers instead, with the real C signatures and CUresult codes:
 *
 *   cuInit, cuCheckpointProcessLock / Unlock / GetState / Checkpoint / Restore,
 *   cuGetErrorName.
 *
 * State is shared by every process that loads it (kiwid and its worker threads,
 * `kiwid recover`, the tests) and by the tenant programs (cuda_tenant.py): it
 * lives in the directory named by $KIWI_STANDIN_CUDA. Its layout, which
 * tests/stand_ins/cudadir.py reads and writes for Python:
 *
 *   config            "key value" lines, every value an integer:
 *                       capacity N          the card's memory, bytes
 *                       foreign N           memory no process shows, bytes
 *                       checkpoint_rate N   bytes/s a checkpoint copies (0: instant)
 *                       restore_rate N      bytes/s a restore copies (0: instant)
 *                       oom_sticks 0|1      1: a restore that runs out of memory
 *                                           leaves the process stuck, as some r580
 *                                           drivers do (cuda-checkpoint issue 44)
 *   lock              flock(2)ed around every read-modify-write of procs/ and faults/
 *   procs/PID         one CUDA process ("a context"): "key value" lines
 *                       state S     CUprocessState: RUNNING 0, LOCKED 1, CHECKPOINTED 2
 *                       memory N    its device memory, bytes
 *                       stuck 0|1   restores fail (304) until cleared (see faults)
 *                       moving M    0; 1: a checkpoint, 2: a restore in flight...
 *                       until T     ...which ends at CLOCK_MONOTONIC T (ns)
 *                       start T     the process's start time (/proc/PID/stat field
 *                                   22); 0: not checked
 *                     written atomically (temporary file, rename) under the lock.
 *                     An entry whose process is gone (no /proc/PID, a zombie, or
 *                     another start time: the PID was reused) is no process: the
 *                     driver frees a dead process's memory.
 *   faults/PID.OP     a fault for the next calls of OP (lock, unlock, checkpoint,
 *                     restore, state) on PID; one line:
 *                       fail CODE TIMES   the call returns CUresult CODE
 *                       hang SECS TIMES   the call blocks SECS seconds (a fraction
 *                                         too; 0: until cleared), then does its
 *                                         normal work; a lock with a timeout
 *                                         gives up at its timeout with
 *                                         CUDA_ERROR_TIMEOUT
 *                       stuck TIMES       the call fails with 304 and leaves the
 *                                         process CHECKPOINTED and stuck
 *                       oom TIMES         the call returns CUDA_ERROR_OUT_OF_MEMORY
 *                       none              cleared
 *                     TIMES counts down with each call it applies to; at 0 the file
 *                     goes (a hang's stays as "hang SECS 0" while its call blocks).
 *                     Clearing is removing the file or writing "none"; a "none" for
 *                     any OP of PID also clears PID's stuck flag at PID's next call.
 *   lost              if it exists the GPU fell off the bus: every call fails.
 *
 * Transitions follow the driver: lock only a RUNNING process, unlock only a
 * LOCKED one, checkpoint only a LOCKED one (its memory leaves the card), restore
 * only a CHECKPOINTED one (it comes back LOCKED) and only if its memory fits
 * beside the resident processes and the foreign memory; anything else is
 * CUDA_ERROR_ILLEGAL_STATE. A checkpoint or restore takes memory/rate seconds;
 * meanwhile its memory stays (or is already) reserved on the card, and every
 * other call on it waits for it to end, GetState too, as the driver serialises
 * the calls on one process (an H200, driver 580.159.04: a GetState asked during a
 * checkpoint of the same process returned when the checkpoint did). The
 * end is a time in the entry, so whoever reads it after that time sees the
 * operation done, even if the caller died (the driver finishes it in the target).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};
/* What a GPU that fell off the bus answers. CUDA_ERROR_DEVICE_UNAVAILABLE (46) is
 * for a device busy in an exclusive compute mode; after an Xid 79 the driver API
 * answers CUDA_ERROR_UNKNOWN, which is what applications check for it. */
#define LOST_GPU_ERROR CUDA_ERROR_UNKNOWN
/* What a pid without CUDA state gets: the driver has nothing initialised for it
 * (kiwid's gate sees the same for a process being torn down). */
#define NOT_A_CUDA_PROCESS CUDA_ERROR_NOT_INITIALIZED

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2 };
enum { STILL = 0, CHECKPOINTING = 1, RESTORING = 2 };
enum { OP_LOCK, OP_UNLOCK, OP_CHECKPOINT, OP_RESTORE, OP_STATE, OPS };
static const char *const OP_NAMES[OPS] = {"lock", "unlock", "checkpoint", "restore", "state"};

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    uint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
    uint64_t reserved[8];
} CUcheckpointArgs; /* the unlock, checkpoint and restore arguments alike */

typedef struct {
    int state, stuck, moving;
    long long memory, until, start;
} proc_t;

typedef struct {
    long long capacity, foreign, checkpoint_rate, restore_rate, oom_sticks;
} config_t;

static int initialised;

/* ---------------------------------------------------------------- plumbing */

static const char *root(void) { return getenv("KIWI_STANDIN_CUDA"); }

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void sleep_until(long long when_ns) {
    struct timespec t = {when_ns / 1000000000LL, when_ns % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
    }
}

static void path_of(char *out, const char *name, int pid, int op) {
    if (op >= 0)
        snprintf(out, PATH_MAX, "%s/faults/%d.%s", root(), pid, OP_NAMES[op]);
    else if (pid > 0)
        snprintf(out, PATH_MAX, "%s/procs/%d", root(), pid);
    else
        snprintf(out, PATH_MAX, "%s/%s", root(), name);
}

/* Take the directory's lock; -1 if it cannot be had. */
static int lock_dir(void) {
    char path[PATH_MAX];
    path_of(path, "lock", 0, -1);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    while (flock(fd, LOCK_EX) < 0) {
        if (errno != EINTR) {
            close(fd);
            return -1;
        }
    }
    return fd;
}

static void unlock_dir(int fd) {
    flock(fd, LOCK_UN);
    close(fd);
}

/* Read "key value" lines; calls set(key, value, ctx) for each. 0 if no file. */
static int read_pairs(const char *path, void (*set)(const char *, long long, void *), void *ctx) {
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    char line[256], key[64];
    long long value;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "%63s %lld", key, &value) == 2)
            set(key, value, ctx);
    fclose(f);
    return 1;
}

static void set_config(const char *key, long long value, void *ctx) {
    config_t *c = ctx;
    if (strcmp(key, "capacity") == 0) c->capacity = value;
    else if (strcmp(key, "foreign") == 0) c->foreign = value;
    else if (strcmp(key, "checkpoint_rate") == 0) c->checkpoint_rate = value;
    else if (strcmp(key, "restore_rate") == 0) c->restore_rate = value;
    else if (strcmp(key, "oom_sticks") == 0) c->oom_sticks = value;
}

static config_t read_config(void) {
    config_t c = {0};
    char path[PATH_MAX];
    path_of(path, "config", 0, -1);
    read_pairs(path, set_config, &c);
    return c;
}

static void set_proc(const char *key, long long value, void *ctx) {
    proc_t *p = ctx;
    if (strcmp(key, "state") == 0) p->state = (int)value;
    else if (strcmp(key, "memory") == 0) p->memory = value;
    else if (strcmp(key, "stuck") == 0) p->stuck = (int)value;
    else if (strcmp(key, "moving") == 0) p->moving = (int)value;
    else if (strcmp(key, "until") == 0) p->until = value;
    else if (strcmp(key, "start") == 0) p->start = value;
}

/* Write a file atomically: a temporary file in the same directory, then rename. */
static int write_atomic(const char *path, const char *text) {
    char tmp[PATH_MAX + 32];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "we");
    if (f == NULL)
        return -1;
    int ok = fputs(text, f) >= 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static void write_proc(int pid, const proc_t *p) {
    char path[PATH_MAX], text[256];
    path_of(path, NULL, pid, -1);
    snprintf(text, sizeof text, "state %d\nmemory %lld\nstuck %d\nmoving %d\nuntil %lld\nstart %lld\n",
             p->state, p->memory, p->stuck, p->moving, p->until, p->start);
    write_atomic(path, text);
}

/* Whether the process an entry names still lives (not a zombie, not a reused PID). */
static int alive(int pid, long long start) {
    char path[64], text[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    char *rest = strrchr(text, ')');
    if (rest == NULL)
        return 0;
    char state;
    unsigned long long started = 0;
    /* after "(comm)": state, then fields 4..21, then 22 starttime */
    if (sscanf(rest + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s "
                         "%*s %*s %llu", &state, &started) != 2)
        return 0;
    return state != 'Z' && state != 'X' && (start == 0 || (long long)started == start);
}

/* Load a live process's entry (lock held): 0 if it is no CUDA process. An
 * operation whose time is over is done; a dead process's entry is dropped. */
static int load(int pid, proc_t *p) {
    char path[PATH_MAX];
    path_of(path, NULL, pid, -1);
    memset(p, 0, sizeof *p);
    if (!read_pairs(path, set_proc, p))
        return 0;
    if (!alive(pid, p->start)) {
        unlink(path);
        return 0;
    }
    if (p->moving != STILL && now_ns() >= p->until) {
        p->state = p->moving == CHECKPOINTING ? CHECKPOINTED : LOCKED;
        p->moving = STILL;
        write_proc(pid, p);
    }
    return 1;
}

static int resident(const proc_t *p) { return p->state != CHECKPOINTED || p->moving == RESTORING; }

/* The device memory of every live process on the card but ``except`` (lock held). */
static long long resident_bytes(int except) {
    char path[PATH_MAX];
    path_of(path, "procs", 0, -1);
    DIR *d = opendir(path);
    if (d == NULL)
        return 0;
    long long sum = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        proc_t p;
        if (*end == '\0' && pid > 0 && pid != except && load((int)pid, &p) && resident(&p))
            sum += p.memory;
    }
    closedir(d);
    return sum;
}

static int gpu_lost(void) {
    char path[PATH_MAX];
    path_of(path, "lost", 0, -1);
    return access(path, F_OK) == 0;
}

/* ---------------------------------------------------------------- faults */

typedef struct {
    char kind[16]; /* "", "none", "fail", "hang", "stuck", "oom" */
    double arg;    /* fail: the CUresult; hang: seconds (0: until cleared) */
    long long times;
} fault_t;

static fault_t read_fault(int pid, int op) {
    fault_t f = {"", 0, 0};
    char path[PATH_MAX], line[128];
    path_of(path, NULL, pid, op);
    FILE *file = fopen(path, "re");
    if (file == NULL)
        return f;
    if (fgets(line, sizeof line, file) != NULL) {
        int n = sscanf(line, "%15s %lf %lld", f.kind, &f.arg, &f.times);
        if (n >= 1 && (strcmp(f.kind, "stuck") == 0 || strcmp(f.kind, "oom") == 0)) {
            f.times = n >= 2 ? (long long)f.arg : 1;
            f.arg = 0;
        } else if (n == 2) {
            f.times = 1;
        }
    }
    fclose(file);
    return f;
}

/* Take the fault for this call (lock held): count it down, and consume the
 * "none" files of ``pid``, which clear its stuck flag. */
static fault_t take_fault(int pid, int op) {
    char path[PATH_MAX], text[128];
    for (int other = 0; other < OPS; other++) {
        if (strcmp(read_fault(pid, other).kind, "none") != 0)
            continue;
        path_of(path, NULL, pid, other);
        unlink(path);
        proc_t p;
        if (load(pid, &p) && p.stuck) {
            p.stuck = 0;
            write_proc(pid, &p);
        }
    }
    fault_t f = read_fault(pid, op);
    if (f.kind[0] == '\0' || f.times <= 0) {
        f.kind[0] = '\0'; /* none, or a spent hang that holds only its own call */
        return f;
    }
    path_of(path, NULL, pid, op);
    if (f.times > 1 || strcmp(f.kind, "hang") == 0) {
        if (strcmp(f.kind, "stuck") == 0 || strcmp(f.kind, "oom") == 0)
            snprintf(text, sizeof text, "%s %lld\n", f.kind, f.times - 1);
        else
            snprintf(text, sizeof text, "%s %.17g %lld\n", f.kind, f.arg, f.times - 1);
        write_atomic(path, text);
    } else {
        unlink(path);
    }
    return f;
}

/* A hang's time is up: its file goes if this was its last call (it reads
 * "hang SECS 0"), as a fault's does when it is over. */
static void end_hang(int pid, int op) {
    int fd = lock_dir();
    fault_t f = read_fault(pid, op);
    if (strcmp(f.kind, "hang") == 0 && f.times <= 0) {
        char path[PATH_MAX];
        path_of(path, NULL, pid, op);
        unlink(path);
    }
    if (fd >= 0)
        unlock_dir(fd);
}

/* Block until the hang is cleared or its time is up; polls every 10 ms. */
static CUresult hang(int pid, int op, double seconds, unsigned int timeout_ms) {
    long long start = now_ns();
    for (;;) {
        if (strcmp(read_fault(pid, op).kind, "hang") != 0)
            return CUDA_SUCCESS; /* cleared: removed, "none" or replaced */
        long long waited = now_ns() - start;
        if (seconds > 0 && waited >= (long long)(seconds * 1e9)) {
            end_hang(pid, op);
            return CUDA_SUCCESS;
        }
        if (timeout_ms > 0 && waited >= (long long)timeout_ms * 1000000LL) {
            end_hang(pid, op);
            return CUDA_ERROR_TIMEOUT; /* the lock gives up, the process still RUNNING */
        }
        sleep_until(now_ns() + 10000000LL);
    }
}

/* ---------------------------------------------------------------- the calls */

/* Checkpoint or restore: the copy takes memory / rate seconds, and its end is
 * written in the entry before waiting for it (lock held, released here). */
static CUresult move(int fd, int pid, proc_t *p, int moving, long long rate) {
    long long ns = rate > 0 ? (long long)((double)p->memory / (double)rate * 1e9) : 0;
    p->moving = moving;
    p->until = now_ns() + ns;
    write_proc(pid, p);
    unlock_dir(fd);
    sleep_until(p->until);
    fd = lock_dir();
    if (fd >= 0) {
        load(pid, p); /* completes it, unless someone read it done already */
        unlock_dir(fd);
    }
    return CUDA_SUCCESS;
}

static CUresult operate(int op, int pid, unsigned int timeout_ms, int *state_out) {
    if (!initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (pid <= 0 || root() == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (gpu_lost())
        return LOST_GPU_ERROR;
    int fd = lock_dir();
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    fault_t f = take_fault(pid, op);
    proc_t p;
    if (strcmp(f.kind, "stuck") == 0) {
        if (load(pid, &p)) {
            p.state = CHECKPOINTED;
            p.stuck = 1;
            p.moving = STILL;
            write_proc(pid, &p);
        }
        unlock_dir(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    unlock_dir(fd);
    if (strcmp(f.kind, "fail") == 0)
        return (CUresult)f.arg;
    if (strcmp(f.kind, "oom") == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (strcmp(f.kind, "hang") == 0) {
        CUresult r = hang(pid, op, f.arg, op == OP_LOCK ? timeout_ms : 0);
        if (r != CUDA_SUCCESS)
            return r;
    }
    for (;;) {
        if ((fd = lock_dir()) < 0)
            return CUDA_ERROR_OPERATING_SYSTEM;
        if (!load(pid, &p)) {
            unlock_dir(fd);
            return NOT_A_CUDA_PROCESS;
        }
        if (p.moving == STILL)
            break;
        unlock_dir(fd); /* another operation on it is in flight: wait for its end */
        sleep_until(p.until);
    }
    if (op == OP_STATE) {
        *state_out = p.state;
        unlock_dir(fd);
        return CUDA_SUCCESS;
    }
    config_t c = read_config();
    CUresult r = CUDA_SUCCESS;
    int want[OPS] = {RUNNING, LOCKED, LOCKED, CHECKPOINTED};
    if (p.state != want[op]) {
        r = CUDA_ERROR_ILLEGAL_STATE;
    } else if (op == OP_LOCK || op == OP_UNLOCK) {
        p.state = op == OP_LOCK ? LOCKED : RUNNING;
        write_proc(pid, &p);
    } else if (op == OP_CHECKPOINT) {
        return move(fd, pid, &p, CHECKPOINTING, c.checkpoint_rate);
    } else if (p.stuck) {
        r = CUDA_ERROR_OPERATING_SYSTEM; /* issue 44: every restore after the first */
    } else if (resident_bytes(pid) + c.foreign + p.memory > c.capacity) {
        if (c.oom_sticks) {
            p.stuck = 1;
            write_proc(pid, &p);
        }
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        return move(fd, pid, &p, RESTORING, c.restore_rate);
    }
    unlock_dir(fd);
    return r;
}

static int reserved_set(const uint64_t *reserved, int n) {
    for (int i = 0; i < n; i++)
        if (reserved[i] != 0)
            return 1;
    return 0;
}

CUresult cuInit(unsigned int flags) {
    struct stat st;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (root() == NULL || stat(root(), &st) != 0 || !S_ISDIR(st.st_mode))
        return CUDA_ERROR_NO_DEVICE;
    if (gpu_lost())
        return LOST_GPU_ERROR;
    __atomic_store_n(&initialised, 1, __ATOMIC_SEQ_CST);
    return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    if (args != NULL && (args->reserved0 != 0 || reserved_set(args->reserved1, 7)))
        return CUDA_ERROR_INVALID_VALUE;
    return operate(OP_LOCK, pid, args != NULL ? args->timeoutMs : 0, NULL);
}

static CUresult simple(int op, int pid, const CUcheckpointArgs *args) {
    if (args != NULL && reserved_set(args->reserved, 8))
        return CUDA_ERROR_INVALID_VALUE;
    return operate(op, pid, 0, NULL);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointArgs *args) {
    return simple(OP_UNLOCK, pid, args);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointArgs *args) {
    return simple(OP_CHECKPOINT, pid, args);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointArgs *args) {
    return simple(OP_RESTORE, pid, args);
}

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (state == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return operate(OP_STATE, pid, 0, state);
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    static const struct {
        CUresult code;
        const char *name;
    } names[] = {
        {0, "CUDA_SUCCESS"},
        {1, "CUDA_ERROR_INVALID_VALUE"},
        {2, "CUDA_ERROR_OUT_OF_MEMORY"},
        {3, "CUDA_ERROR_NOT_INITIALIZED"},
        {4, "CUDA_ERROR_DEINITIALIZED"},
        {46, "CUDA_ERROR_DEVICE_UNAVAILABLE"},
        {100, "CUDA_ERROR_NO_DEVICE"},
        {304, "CUDA_ERROR_OPERATING_SYSTEM"},
        {401, "CUDA_ERROR_ILLEGAL_STATE"},
        {600, "CUDA_ERROR_NOT_READY"},
        {801, "CUDA_ERROR_NOT_SUPPORTED"},
        {909, "CUDA_ERROR_TIMEOUT"},
        {999, "CUDA_ERROR_UNKNOWN"},
    };
    if (name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (names[i].code == error) {
            *name = names[i].name;
            return CUDA_SUCCESS;
        }
    }
    *name = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
