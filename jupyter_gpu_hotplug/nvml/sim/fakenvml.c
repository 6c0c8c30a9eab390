/*
 * fakenvml.c - a simulated NVIDIA Management Library (libnvidia-ml.so.1).
 *
 * Part of jupyter-gpu-hotplug.  It lets the product's simulation mode and its
 * tests run the real, unmodified `pynvml` (nvidia-ml-py) on machines without a
 * GPU or driver.  Build (jupyter_gpu_hotplug/nvml/sim/build.py does this):
 *
 *     cc -O2 -fPIC -shared -pthread -fvisibility=hidden \
 *        -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fakenvml.c
 *
 * The SONAME matters: pynvml calls dlopen("libnvidia-ml.so.1"), which glibc
 * answers with an already loaded library of that SONAME, so a process can load
 * this file by absolute path first; a child finds it through LD_LIBRARY_PATH.
 *
 * ENVIRONMENT (read by every nvmlInit*() call, never later)
 *
 *   FAKE_NVML_CONFIG=<path>        the simulated node (format below).  Unset or
 *                                  missing file: init fails with 9
 *                                  (NVML_ERROR_DRIVER_NOT_LOADED), as NVML does
 *                                  on a host without the driver.
 *   FAKE_NVML_INIT_ERROR=<code>    init fails with this nvmlReturn_t, e.g. 9.
 *   FAKE_NVML_DEVICE_FILTER=<dir>  container view: a GPU is visible only while
 *                                  <dir>/nvidia<minor> is a character device.
 *                                  Real NVML inside a container sees exactly the
 *                                  GPUs whose nodes exist in its /dev, so this
 *                                  is how a sandboxed process sees only its
 *                                  hot-attached GPUs.  Re-evaluated by every
 *                                  count and handle lookup (no re-init needed).
 *
 * CONFIG FILE, format version 1 (jupyter_gpu_hotplug/nvml/sim/config.py
 * writes and reads the same format)
 *
 *   Line based.  Blank lines and lines starting with '#' are ignored; other
 *   lines are `key=value` (whitespace around key and value is trimmed) or a
 *   section header `[gpu]` that starts the next GPU.  The first setting must be
 *   `version=1`.  Unknown keys, repeated keys and bad values are errors: init
 *   then fails with 999 (NVML_ERROR_UNKNOWN); a bad file that replaces a good
 *   one at run time is ignored (the last good state stays).  Either way the
 *   reason, with file and line, goes to stderr and to fakeNvmlGetLastError().
 *
 *     version=1
 *     driver_version=550.54.15      nvmlSystemGetDriverVersion (default shown)
 *     cuda_driver_version=12040     nvmlSystemGetCudaDriverVersion (12.4)
 *
 *     [gpu]
 *     uuid=GPU-...                  required, unique, at most 95 bytes
 *     minor=0                       required, unique, 0..254 (/dev/nvidia<minor>)
 *     name=...                      default "NVIDIA GPU (simulated)"
 *     pci_bus_id=00000000:18:00.0   default 00000000:<minor+1>:00.0 (hex)
 *     pci_device_id=0x233010DE      device id << 16 | vendor id (default shown)
 *     memory_total=85520809984      bytes (default 0)
 *     memory_used=0                 bytes, at most memory_total
 *     utilization_gpu=0             percent, 0..100
 *     utilization_memory=0          percent, 0..100
 *     temperature=30                degrees C (default 30)
 *     power_usage=70000             milliwatts (default 0)
 *     power_limit=700000            milliwatts (default 0)
 *     compute_capability=9.0        major.minor (default 9.0)
 *     processes=4242:1073741824,... compute processes as pid:used_bytes; `pid:na`
 *                                   reports the memory as not available (pynvml
 *                                   gives None), as NVML does in many containers
 *     lost=0                        1: the GPU "fell off the bus": every query
 *                                   returns 15 (NVML_ERROR_GPU_IS_LOST)
 *
 *   GPUs are enumerated (NVML index) in file order among the visible ones.
 *   At most 64 GPUs, 64 processes per GPU, 1 MiB of file.
 *
 * RE-READING
 *
 *   Every call that reads simulated state first stat()s the config path and
 *   reloads when device, inode, size, mtime or ctime differ from the loaded
 *   file.  Writers should replace the file atomically (write a temp file,
 *   rename it over the path).  The loaded file is kept open, which pins its
 *   inode number, so an atomic replacement is always seen, however quickly it
 *   follows the previous one.
 *
 * HANDLES
 *
 *   A device handle is bound to a UUID for the life of the process, across
 *   reloads.  Once its GPU is gone from the file or marked lost, queries on
 *   the handle return NVML_ERROR_GPU_IS_LOST.  Per-handle queries do not
 *   re-check the device filter: like a process that opened a GPU before it was
 *   revoked, a holder of a handle keeps reading it.
 *
 * All entry points are thread-safe (one mutex guards all state).
 * Not simulated: MIG (nvmlDeviceGetMigMode answers NOT_SUPPORTED), graphics
 * processes (always none), every function not defined here (pynvml then
 * raises NVMLError_FunctionNotFound).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

/* ----- NVML ABI: values and layouts exactly as in nvml.h and pynvml.py ----- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_TEMPERATURE_GPU 0u
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFull
#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)sizeof(type) | ((unsigned int)(ver) << 24))

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

/* nvmlProcessInfo_v2_t; pynvml uses the same layout for _v3. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

_Static_assert(nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2_t layout differs from pynvml");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout differs from pynvml");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout differs from pynvml");

/* ----- the simulated node ----- */

#define CONFIG_FORMAT 1u
#define MAX_GPUS 64
#define MAX_PROCS 64
#define MAX_CONFIG_BYTES (1u << 20)
#define MAX_GPU_MINOR 254u /* 255 is /dev/nvidiactl */
#define TEXT_LEN 96        /* NVML_DEVICE_{UUID,NAME}_V2_BUFFER_SIZE */
#define VERSION_LEN 80     /* NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE */

struct sim_process {
    unsigned int pid;
    unsigned long long used_memory;
};

struct gpu_spec {
    char uuid[TEXT_LEN];
    char name[TEXT_LEN];
    unsigned int minor;
    unsigned int pci_domain, pci_bus, pci_device, pci_function, pci_device_id;
    unsigned long long memory_total, memory_used;
    unsigned int utilization_gpu, utilization_memory, temperature;
    unsigned int power_usage, power_limit;
    unsigned int cc_major, cc_minor;
    int lost;
    unsigned int nprocs;
    struct sim_process procs[MAX_PROCS];
};

struct sim_config {
    char driver_version[VERSION_LEN];
    unsigned int cuda_driver_version;
    unsigned int ngpus;
    struct gpu_spec gpus[MAX_GPUS];
};

/*
 * A device handle points at a slot.  Slots are created the first time a UUID
 * appears and are never freed, so a handle stays bound to its GPU across
 * reloads and can always be validated by address.
 */
struct nvmlDevice_st {
    struct gpu_spec spec;
    int present; /* in the currently loaded config */
};
typedef struct nvmlDevice_st *nvmlDevice_t;

static struct {
    pthread_mutex_t lock;
    unsigned int refcount; /* nvmlInit minus nvmlShutdown calls */
    char config_path[PATH_MAX];
    char filter_dir[PATH_MAX];
    int filtered;
    int config_fd;        /* the loaded file, held open to pin its inode */
    struct stat loaded;   /* identity of config_fd's file */
    struct stat rejected; /* last file that failed to parse; not retried until it changes */
    int have_rejected;
    char driver_version[VERSION_LEN];
    unsigned int cuda_driver_version;
    nvmlDevice_t *slots;
    unsigned int nslots, slot_capacity;
    nvmlDevice_t order[MAX_GPUS]; /* present GPUs, in file order */
    unsigned int norder;
    char last_error[512];
} st = {.lock = PTHREAD_MUTEX_INITIALIZER, .config_fd = -1};

/* Record why something failed; `loud` also tells stderr, because a broken
 * simulation otherwise only shows up as an opaque NVML error code. */
__attribute__((format(printf, 2, 3))) static void set_error(int loud, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st.last_error, sizeof st.last_error, fmt, ap);
    va_end(ap);
    if (loud)
        fprintf(stderr, "fake-nvml: %s\n", st.last_error);
}

/* ----- config parsing (pure: text in, struct sim_config out) ----- */

struct parser {
    const char *path;
    unsigned int line;
    char *err;
    size_t errlen;
};

__attribute__((format(printf, 2, 3))) static int parse_fail(struct parser *p, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (p->line)
        snprintf(p->err, p->errlen, "%s:%u: %s", p->path, p->line, msg);
    else
        snprintf(p->err, p->errlen, "%s: %s", p->path, msg);
    return -1;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

/* Strict unsigned number in base 10 or 16: digits only, no sign, no prefix,
 * no trailing junk, at most `max`. */
static int parse_ull(const char *s, int base, unsigned long long max, unsigned long long *out)
{
    if (*s == '\0')
        return -1;
    for (const char *c = s; *c; c++)
        if (base == 16 ? !isxdigit((unsigned char)*c) : !isdigit((unsigned char)*c))
            return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno != 0 || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_uint(const char *s, unsigned int max, unsigned int *out)
{
    unsigned long long v;
    if (parse_ull(s, 10, max, &v) != 0)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

/* Hex digits only, `len` bytes of `s`, at most `max`. */
static int parse_hex_field(const char *s, size_t len, unsigned long long max, unsigned int *out)
{
    if (len == 0 || len > 8)
        return -1;
    unsigned long long v = 0;
    for (size_t i = 0; i < len; i++) {
        if (!isxdigit((unsigned char)s[i]))
            return -1;
        int c = tolower((unsigned char)s[i]);
        v = v * 16 + (unsigned long long)(isdigit(c) ? c - '0' : c - 'a' + 10);
    }
    if (v > max)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

/* "DDDDDDDD:BB:DD.F", "DDDD:BB:DD.F" or "BB:DD.F" (domain 0), hex. */
static int parse_bus_id(const char *s, unsigned int *domain, unsigned int *bus, unsigned int *device,
                        unsigned int *function)
{
    const char *dot = strrchr(s, '.');
    const char *last_colon = strrchr(s, ':');
    if (!dot || !last_colon || dot < last_colon)
        return -1;
    const char *first_colon = strchr(s, ':');
    const char *bus_start = s;
    *domain = 0;
    if (first_colon != last_colon) {
        if (parse_hex_field(s, (size_t)(first_colon - s), 0xFFFFFFFFull, domain) != 0)
            return -1;
        bus_start = first_colon + 1;
    }
    if (parse_hex_field(bus_start, (size_t)(last_colon - bus_start), 0xFF, bus) != 0 ||
        parse_hex_field(last_colon + 1, (size_t)(dot - last_colon - 1), 0x1F, device) != 0 ||
        parse_hex_field(dot + 1, strlen(dot + 1), 0x7, function) != 0)
        return -1;
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"1", "true", "yes"}, *const no[] = {"0", "false", "no"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

static int set_text(struct parser *p, char *dst, const char *key, const char *value)
{
    size_t len = strlen(value);
    if (len == 0)
        return parse_fail(p, "%s must not be empty", key);
    if (len >= TEXT_LEN)
        return parse_fail(p, "%s is longer than %d bytes", key, TEXT_LEN - 1);
    memcpy(dst, value, len + 1);
    return 0;
}

static int parse_processes(struct parser *p, struct gpu_spec *g, char *value)
{
    g->nprocs = 0;
    if (*value == '\0')
        return 0;
    for (char *rest = value, *tok; (tok = strsep(&rest, ",")) != NULL;) {
        tok = trim(tok);
        char *colon = strchr(tok, ':');
        if (!colon)
            return parse_fail(p, "process %s: expected pid:used_bytes", tok);
        *colon = '\0';
        unsigned int pid;
        unsigned long long used = NVML_VALUE_NOT_AVAILABLE_ULL;
        const char *used_text = trim(colon + 1);
        if (parse_uint(trim(tok), UINT_MAX, &pid) != 0 || pid == 0 ||
            (strcmp(used_text, "na") != 0 && parse_ull(used_text, 10, ULLONG_MAX - 1, &used) != 0))
            return parse_fail(p, "process %s:%s: expected pid:used_bytes or pid:na", tok, used_text);
        if (g->nprocs == MAX_PROCS)
            return parse_fail(p, "more than %d processes", MAX_PROCS);
        g->procs[g->nprocs].pid = pid;
        g->procs[g->nprocs].used_memory = used;
        g->nprocs++;
    }
    return 0;
}

enum gpu_key {
    K_UUID, K_MINOR, K_NAME, K_PCI_BUS_ID, K_PCI_DEVICE_ID, K_MEMORY_TOTAL, K_MEMORY_USED,
    K_UTILIZATION_GPU, K_UTILIZATION_MEMORY, K_TEMPERATURE, K_POWER_USAGE, K_POWER_LIMIT,
    K_COMPUTE_CAPABILITY, K_PROCESSES, K_LOST, K_GPU_KEY_COUNT
};
static const char *const gpu_keys[K_GPU_KEY_COUNT] = {
    "uuid", "minor", "name", "pci_bus_id", "pci_device_id", "memory_total", "memory_used",
    "utilization_gpu", "utilization_memory", "temperature", "power_usage", "power_limit",
    "compute_capability", "processes", "lost",
};

enum global_key { G_VERSION, G_DRIVER_VERSION, G_CUDA_DRIVER_VERSION, G_KEY_COUNT };
static const char *const global_keys[G_KEY_COUNT] = {"version", "driver_version", "cuda_driver_version"};

static int lookup_key(const char *const *keys, int n, const char *key)
{
    for (int i = 0; i < n; i++)
        if (strcmp(keys[i], key) == 0)
            return i;
    return -1;
}

static void gpu_defaults(struct gpu_spec *g)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA GPU (simulated)");
    g->pci_device_id = 0x233010DEu;
    g->temperature = 30;
    g->cc_major = 9;
}

static int set_gpu_key(struct parser *p, struct gpu_spec *g, enum gpu_key k, char *value)
{
    unsigned int *uint_field = NULL;
    unsigned int uint_max = UINT_MAX;
    switch (k) {
    case K_UUID:
        return set_text(p, g->uuid, "uuid", value);
    case K_NAME:
        return set_text(p, g->name, "name", value);
    case K_MINOR:
        uint_field = &g->minor;
        uint_max = MAX_GPU_MINOR;
        break;
    case K_PCI_BUS_ID:
        if (parse_bus_id(value, &g->pci_domain, &g->pci_bus, &g->pci_device, &g->pci_function) != 0)
            return parse_fail(p, "pci_bus_id %s: expected DOMAIN:BUS:DEVICE.FUNCTION in hex", value);
        return 0;
    case K_PCI_DEVICE_ID: {
        unsigned long long v;
        int hex = value[0] == '0' && (value[1] == 'x' || value[1] == 'X');
        if (parse_ull(hex ? value + 2 : value, hex ? 16 : 10, UINT_MAX, &v) != 0)
            return parse_fail(p, "pci_device_id %s: expected a 32-bit number such as 0x233010DE", value);
        g->pci_device_id = (unsigned int)v;
        return 0;
    }
    case K_MEMORY_TOTAL:
    case K_MEMORY_USED:
        if (parse_ull(value, 10, ULLONG_MAX,
                      k == K_MEMORY_TOTAL ? &g->memory_total : &g->memory_used) != 0)
            return parse_fail(p, "%s %s: expected bytes", gpu_keys[k], value);
        return 0;
    case K_UTILIZATION_GPU:
        uint_field = &g->utilization_gpu;
        uint_max = 100;
        break;
    case K_UTILIZATION_MEMORY:
        uint_field = &g->utilization_memory;
        uint_max = 100;
        break;
    case K_TEMPERATURE:
        uint_field = &g->temperature;
        uint_max = 200;
        break;
    case K_POWER_USAGE:
        uint_field = &g->power_usage;
        break;
    case K_POWER_LIMIT:
        uint_field = &g->power_limit;
        break;
    case K_COMPUTE_CAPABILITY: {
        char *dot = strchr(value, '.');
        if (dot)
            *dot = '\0';
        if (!dot || parse_uint(value, 99, &g->cc_major) != 0 ||
            parse_uint(dot + 1, 99, &g->cc_minor) != 0)
            return parse_fail(p, "compute_capability: expected MAJOR.MINOR");
        return 0;
    }
    case K_PROCESSES:
        return parse_processes(p, g, value);
    case K_LOST:
        if (parse_bool(value, &g->lost) != 0)
            return parse_fail(p, "lost %s: expected 0 or 1", value);
        return 0;
    case K_GPU_KEY_COUNT:
        break;
    }
    if (!uint_field || parse_uint(value, uint_max, uint_field) != 0)
        return parse_fail(p, "%s %s: expected a whole number from 0 to %u", gpu_keys[k], value,
                          uint_max);
    return 0;
}

static int set_global_key(struct parser *p, struct sim_config *cfg, enum global_key k, const char *value)
{
    switch (k) {
    case G_VERSION:
        return parse_fail(p, "version may appear only once, as the first setting");
    case G_DRIVER_VERSION: {
        size_t len = strlen(value);
        if (len == 0 || len >= VERSION_LEN)
            return parse_fail(p, "driver_version must be 1 to %d bytes", VERSION_LEN - 1);
        memcpy(cfg->driver_version, value, len + 1);
        return 0;
    }
    case G_CUDA_DRIVER_VERSION:
        if (parse_uint(value, INT_MAX, &cfg->cuda_driver_version) != 0)
            return parse_fail(p, "cuda_driver_version %s: expected e.g. 12040 for CUDA 12.4", value);
        return 0;
    case G_KEY_COUNT:
        break;
    }
    return parse_fail(p, "unknown setting");
}

/* Checks that need the whole GPU section. */
static int finish_gpu(struct parser *p, struct gpu_spec *g, unsigned int seen)
{
    if (!(seen & (1u << K_UUID)))
        return parse_fail(p, "GPU section without uuid");
    if (!(seen & (1u << K_MINOR)))
        return parse_fail(p, "GPU %s has no minor", g->uuid);
    if (g->memory_used > g->memory_total)
        return parse_fail(p, "GPU %s: memory_used exceeds memory_total", g->uuid);
    if (!(seen & (1u << K_PCI_BUS_ID)))
        g->pci_bus = g->minor + 1;
    return 0;
}

static int check_unique(struct parser *p, const struct sim_config *cfg)
{
    p->line = 0;
    for (unsigned int i = 0; i < cfg->ngpus; i++)
        for (unsigned int j = 0; j < i; j++) {
            if (strcmp(cfg->gpus[i].uuid, cfg->gpus[j].uuid) == 0)
                return parse_fail(p, "uuid %s appears twice", cfg->gpus[i].uuid);
            if (cfg->gpus[i].minor == cfg->gpus[j].minor)
                return parse_fail(p, "minor %u appears twice", cfg->gpus[i].minor);
        }
    return 0;
}

/* Parse `text` (modified in place) into `cfg`; on failure write the reason to `err`. */
static int parse_config(char *text, const char *path, struct sim_config *cfg, char *err, size_t errlen)
{
    struct parser p = {.path = path, .err = err, .errlen = errlen};
    struct gpu_spec *gpu = NULL;
    unsigned int seen = 0; /* keys seen in the current section, as bits */
    int have_version = 0;

    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->driver_version, sizeof cfg->driver_version, "550.54.15");
    cfg->cuda_driver_version = 12040;

    for (char *line = text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        p.line++;
        line = trim(line);
        if (*line == '\0' || *line == '#')
            continue;
        if (!have_version) {
            unsigned int version;
            char *eq = strchr(line, '=');
            if (!eq)
                return parse_fail(&p, "the first setting must be version=%u", CONFIG_FORMAT);
            *eq = '\0';
            if (strcmp(trim(line), "version") != 0)
                return parse_fail(&p, "the first setting must be version=%u", CONFIG_FORMAT);
            if (parse_uint(trim(eq + 1), UINT_MAX, &version) != 0 || version != CONFIG_FORMAT)
                return parse_fail(&p, "unsupported format version %s (this library reads version %u)",
                                  trim(eq + 1), CONFIG_FORMAT);
            have_version = 1;
            continue;
        }
        if (*line == '[') {
            if (strcmp(line, "[gpu]") != 0)
                return parse_fail(&p, "unknown section %s", line);
            if (gpu && finish_gpu(&p, gpu, seen) != 0)
                return -1;
            if (cfg->ngpus == MAX_GPUS)
                return parse_fail(&p, "more than %d GPUs", MAX_GPUS);
            gpu = &cfg->gpus[cfg->ngpus++];
            gpu_defaults(gpu);
            seen = 0;
            continue;
        }
        char *eq = strchr(line, '=');
        if (!eq)
            return parse_fail(&p, "expected key=value or [gpu]");
        *eq = '\0';
        char *key = trim(line), *value = trim(eq + 1);
        int k = gpu ? lookup_key(gpu_keys, K_GPU_KEY_COUNT, key)
                    : lookup_key(global_keys, G_KEY_COUNT, key);
        if (k < 0)
            return parse_fail(&p, "unknown %s key %s", gpu ? "GPU" : "global", key);
        if (seen & (1u << k))
            return parse_fail(&p, "%s given twice", key);
        seen |= 1u << k;
        int rc = gpu ? set_gpu_key(&p, gpu, (enum gpu_key)k, value)
                     : set_global_key(&p, cfg, (enum global_key)k, value);
        if (rc != 0)
            return -1;
    }
    if (!have_version)
        return parse_fail(&p, "no version=%u line (is this a fake NVML config?)", CONFIG_FORMAT);
    if (gpu && finish_gpu(&p, gpu, seen) != 0)
        return -1;
    return check_unique(&p, cfg);
}

/* ----- loading and reloading (caller holds st.lock) ----- */

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
           a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

static nvmlDevice_t find_slot_locked(const char *uuid)
{
    for (unsigned int i = 0; i < st.nslots; i++)
        if (strcmp(st.slots[i]->spec.uuid, uuid) == 0)
            return st.slots[i];
    return NULL;
}

static int is_slot_locked(nvmlDevice_t d)
{
    for (unsigned int i = 0; i < st.nslots; i++)
        if (st.slots[i] == d)
            return 1;
    return 0;
}

static int add_slot_locked(const char *uuid)
{
    if (st.nslots == st.slot_capacity) {
        unsigned int capacity = st.slot_capacity ? st.slot_capacity * 2 : 16;
        nvmlDevice_t *grown = realloc(st.slots, capacity * sizeof *grown);
        if (!grown)
            return -1;
        st.slots = grown;
        st.slot_capacity = capacity;
    }
    nvmlDevice_t d = calloc(1, sizeof *d);
    if (!d)
        return -1;
    snprintf(d->spec.uuid, sizeof d->spec.uuid, "%s", uuid);
    st.slots[st.nslots++] = d;
    return 0;
}

/* Make `cfg` the current state.  All allocation happens before anything
 * changes, so running out of memory leaves the previous state intact. */
static nvmlReturn_t commit_locked(const struct sim_config *cfg)
{
    for (unsigned int i = 0; i < cfg->ngpus; i++)
        if (!find_slot_locked(cfg->gpus[i].uuid) && add_slot_locked(cfg->gpus[i].uuid) != 0)
            return NVML_ERROR_MEMORY;
    for (unsigned int i = 0; i < st.nslots; i++)
        st.slots[i]->present = 0;
    for (unsigned int i = 0; i < cfg->ngpus; i++) {
        nvmlDevice_t d = find_slot_locked(cfg->gpus[i].uuid);
        d->spec = cfg->gpus[i];
        d->present = 1;
        st.order[i] = d;
    }
    st.norder = cfg->ngpus;
    memcpy(st.driver_version, cfg->driver_version, sizeof st.driver_version);
    st.cuda_driver_version = cfg->cuda_driver_version;
    return NVML_SUCCESS;
}

static int read_all(int fd, char **out)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return -1;
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_CONFIG_BYTES) {
                free(buf);
                errno = EFBIG;
                return -1;
            }
            cap *= 2;
            char *grown = realloc(buf, cap + 1);
            if (!grown) {
                free(buf);
                return -1;
            }
            buf = grown;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            free(buf);
            return -1;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    *out = buf;
    return 0;
}

static nvmlReturn_t errno_to_nvml(int err)
{
    switch (err) {
    case ENOENT:
    case ENOTDIR:
        return NVML_ERROR_DRIVER_NOT_LOADED;
    case EACCES:
    case EPERM:
        return NVML_ERROR_NO_PERMISSION;
    case ENOMEM:
        return NVML_ERROR_MEMORY;
    default:
        return NVML_ERROR_UNKNOWN;
    }
}

static nvmlReturn_t load_config_locked(void)
{
    char errbuf[128];
    struct stat sb;
    char *text = NULL;
    struct sim_config *cfg = NULL;
    nvmlReturn_t rc;

    int fd = open(st.config_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        set_error(1, "cannot open %s: %s", st.config_path, strerror_r(err, errbuf, sizeof errbuf));
        return errno_to_nvml(err);
    }
    if (fstat(fd, &sb) != 0 || read_all(fd, &text) != 0) {
        int err = errno;
        set_error(1, "cannot read %s: %s", st.config_path, strerror_r(err, errbuf, sizeof errbuf));
        rc = errno_to_nvml(err);
        goto out;
    }
    cfg = malloc(sizeof *cfg);
    if (!cfg) {
        rc = NVML_ERROR_MEMORY;
        goto out;
    }
    if (parse_config(text, st.config_path, cfg, st.last_error, sizeof st.last_error) != 0) {
        fprintf(stderr, "fake-nvml: %s\n", st.last_error);
        st.rejected = sb;
        st.have_rejected = 1;
        rc = NVML_ERROR_UNKNOWN;
        goto out;
    }
    rc = commit_locked(cfg);
    if (rc != NVML_SUCCESS)
        goto out;
    if (st.config_fd >= 0)
        close(st.config_fd);
    st.config_fd = fd;
    fd = -1;
    st.loaded = sb;
    st.have_rejected = 0;
    st.last_error[0] = '\0';
out:
    if (fd >= 0)
        close(fd);
    free(cfg);
    free(text);
    return rc;
}

/* Pick up a rewritten config.  A vanished or broken file keeps the last good state. */
static void refresh_locked(void)
{
    struct stat sb;
    if (stat(st.config_path, &sb) != 0 || same_file(&sb, &st.loaded))
        return;
    if (st.have_rejected && same_file(&sb, &st.rejected))
        return;
    (void)load_config_locked();
}

/* The container view: with a filter, only GPUs whose node exists are visible. */
static int visible_locked(nvmlDevice_t d)
{
    if (!d->present)
        return 0;
    if (!st.filtered)
        return 1;
    char path[PATH_MAX + 32];
    struct stat sb;
    snprintf(path, sizeof path, "%s/nvidia%u", st.filter_dir, d->spec.minor);
    return stat(path, &sb) == 0 && S_ISCHR(sb.st_mode);
}

static unsigned int visible_gpus_locked(nvmlDevice_t out[MAX_GPUS])
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < st.norder; i++)
        if (visible_locked(st.order[i]))
            out[n++] = st.order[i];
    return n;
}

/* Every entry point that reads simulated state starts here: take the lock,
 * require nvmlInit, pick up a rewritten config. */
static nvmlReturn_t enter(void)
{
    pthread_mutex_lock(&st.lock);
    if (st.refcount == 0) {
        pthread_mutex_unlock(&st.lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    refresh_locked();
    return NVML_SUCCESS;
}

static void leave(void)
{
    pthread_mutex_unlock(&st.lock);
}

static nvmlReturn_t check_handle_locked(nvmlDevice_t d)
{
    if (!d || !is_slot_locked(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->present || d->spec.lost)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* Copy one GPU's state out, so callers fill NVML structures without the lock. */
static nvmlReturn_t snapshot(nvmlDevice_t d, struct gpu_spec *out)
{
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(d);
    if (rc == NVML_SUCCESS)
        *out = d->spec;
    leave();
    return rc;
}

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(src) + 1;
    if (need > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

/* ----- initialisation ----- */

static nvmlReturn_t injected_init_error_locked(void)
{
    const char *value = getenv("FAKE_NVML_INIT_ERROR");
    unsigned int code;
    if (!value || !*value)
        return NVML_SUCCESS;
    if (parse_uint(value, INT_MAX, &code) != 0) {
        set_error(1, "FAKE_NVML_INIT_ERROR=%s is not an nvmlReturn_t code", value);
        return NVML_ERROR_UNKNOWN;
    }
    set_error(0, "FAKE_NVML_INIT_ERROR=%u injected", code);
    return (nvmlReturn_t)code;
}

static nvmlReturn_t read_environment_locked(void)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    const char *filter = getenv("FAKE_NVML_DEVICE_FILTER");
    if (!path || !*path) {
        set_error(1, "FAKE_NVML_CONFIG is not set: no simulated GPUs to show");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (strlen(path) >= sizeof st.config_path || (filter && strlen(filter) >= sizeof st.filter_dir)) {
        set_error(1, "FAKE_NVML_CONFIG or FAKE_NVML_DEVICE_FILTER is too long");
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    snprintf(st.config_path, sizeof st.config_path, "%s", path);
    st.filtered = filter && *filter;
    snprintf(st.filter_dir, sizeof st.filter_dir, "%s", st.filtered ? filter : "");
    return NVML_SUCCESS;
}

/* Flags (NO_GPUS, NO_ATTACH) change nothing: the simulation never fails for
 * lack of GPUs and attaches nothing. */
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&st.lock);
    nvmlReturn_t rc = injected_init_error_locked();
    if (rc == NVML_SUCCESS)
        rc = read_environment_locked();
    if (rc == NVML_SUCCESS) {
        st.have_rejected = 0;
        rc = load_config_locked();
    }
    if (rc == NVML_SUCCESS)
        st.refcount++;
    pthread_mutex_unlock(&st.lock);
    return rc;
}

API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&st.lock);
    if (st.refcount == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else if (--st.refcount == 0 && st.config_fd >= 0) {
        close(st.config_fd);
        st.config_fd = -1;
        memset(&st.loaded, 0, sizeof st.loaded);
    }
    pthread_mutex_unlock(&st.lock);
    return rc;
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "ECC is not supported with vGPU";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ----- system queries ----- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    char copy[VERSION_LEN];
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    memcpy(copy, st.driver_version, sizeof copy);
    leave();
    return copy_string(version, length, copy);
}

/* Real NVML reports "<CUDA major>.<driver version>", e.g. 12.550.54.15. */
API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    char copy[VERSION_LEN + 16];
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    snprintf(copy, sizeof copy, "%u.%s", st.cuda_driver_version / 1000, st.driver_version);
    leave();
    return copy_string(version, length, copy);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cuda_version)
{
    if (!cuda_version)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    *cuda_version = (int)st.cuda_driver_version;
    leave();
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cuda_version)
{
    return nvmlSystemGetCudaDriverVersion(cuda_version);
}

/* ----- enumeration ----- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlDevice_t visible[MAX_GPUS];
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    *count = visible_gpus_locked(visible);
    leave();
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return nvmlDeviceGetCount_v2(count);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlDevice_t visible[MAX_GPUS];
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int n = visible_gpus_locked(visible);
    if (index >= n)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (visible[index]->spec.lost)
        rc = NVML_ERROR_GPU_IS_LOST;
    else
        *device = visible[index];
    leave();
    return rc;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlDevice_t visible[MAX_GPUS];
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int n = visible_gpus_locked(visible);
    rc = NVML_ERROR_NOT_FOUND;
    for (unsigned int i = 0; i < n; i++) {
        if (strcmp(visible[i]->spec.uuid, uuid) == 0) {
            rc = visible[i]->spec.lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
            if (rc == NVML_SUCCESS)
                *device = visible[i];
            break;
        }
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device)
{
    nvmlDevice_t visible[MAX_GPUS];
    unsigned int domain, bus, dev, function;
    if (!bus_id || !device || parse_bus_id(bus_id, &domain, &bus, &dev, &function) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int n = visible_gpus_locked(visible);
    rc = NVML_ERROR_NOT_FOUND;
    for (unsigned int i = 0; i < n; i++) {
        const struct gpu_spec *g = &visible[i]->spec;
        if (g->pci_domain == domain && g->pci_bus == bus && g->pci_device == dev &&
            g->pci_function == function) {
            rc = g->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
            if (rc == NVML_SUCCESS)
                *device = visible[i];
            break;
        }
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(bus_id, device);
}

/* The index among the GPUs this process sees now; NOT_FOUND once filtered out. */
API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlDevice_t visible[MAX_GPUS];
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(device);
    if (rc == NVML_SUCCESS) {
        unsigned int n = visible_gpus_locked(visible);
        rc = NVML_ERROR_NOT_FOUND;
        for (unsigned int i = 0; i < n; i++) {
            if (visible[i] == device) {
                *index = i;
                rc = NVML_SUCCESS;
                break;
            }
        }
    }
    leave();
    return rc;
}

/* ----- per-device queries ----- */

#define WITH_GPU(device, g)                                                                        \
    struct gpu_spec g;                                                                             \
    do {                                                                                           \
        nvmlReturn_t rc_ = snapshot((device), &g);                                                 \
        if (rc_ != NVML_SUCCESS)                                                                   \
            return rc_;                                                                            \
    } while (0)

static nvmlReturn_t get_uint(nvmlDevice_t device, unsigned int *out, size_t offset)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    memcpy(out, (const char *)&g + offset, sizeof *out);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    WITH_GPU(device, g);
    return copy_string(name, length, g.name);
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    WITH_GPU(device, g);
    return copy_string(uuid, length, g.uuid);
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return get_uint(device, minor, offsetof(struct gpu_spec, minor));
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    memory->total = g.memory_total;
    memory->used = g.memory_used;
    memory->free = g.memory_total - g.memory_used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    WITH_GPU(device, g);
    memory->total = g.memory_total;
    memory->reserved = 0;
    memory->used = g.memory_used;
    memory->free = g.memory_total - g.memory_used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    if (!utilization)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    utilization->gpu = g.utilization_gpu;
    utilization->memory = g.utilization_memory;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor, unsigned int *temp)
{
    if (sensor != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    return get_uint(device, temp, offsetof(struct gpu_spec, temperature));
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts)
{
    return get_uint(device, milliwatts, offsetof(struct gpu_spec, power_usage));
}

API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *milliwatts)
{
    return get_uint(device, milliwatts, offsetof(struct gpu_spec, power_limit));
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *milliwatts)
{
    return get_uint(device, milliwatts, offsetof(struct gpu_spec, power_limit));
}

API nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *milliwatts)
{
    return get_uint(device, milliwatts, offsetof(struct gpu_spec, power_limit));
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    memset(pci, 0, sizeof *pci);
    pci->domain = g.pci_domain;
    pci->bus = g.pci_bus;
    pci->device = g.pci_device;
    pci->pciDeviceId = g.pci_device_id;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", g.pci_domain, g.pci_bus, g.pci_device,
             g.pci_function);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", g.pci_domain & 0xFFFFu,
             g.pci_bus, g.pci_device, g.pci_function);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    *major = (int)g.cc_major;
    *minor = (int)g.cc_minor;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* NVML's two-call protocol: a short buffer gets INSUFFICIENT_SIZE and the
 * needed count; no processes is SUCCESS with a count of 0. */
static nvmlReturn_t get_processes(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos,
                                  int graphics)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    unsigned int n = graphics ? 0 : g.nprocs;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = g.procs[i].pid;
        infos[i].usedGpuMemory = g.procs[i].used_memory;
        infos[i].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        infos[i].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
    }
    *count = n;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                         nvmlProcessInfo_t *infos)
{
    return get_processes(device, count, infos, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                         nvmlProcessInfo_t *infos)
{
    return get_processes(device, count, infos, 0);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                          nvmlProcessInfo_t *infos)
{
    return get_processes(device, count, infos, 1);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                          nvmlProcessInfo_t *infos)
{
    return get_processes(device, count, infos, 1);
}

/* ----- not part of NVML: identification and diagnostics for the simulator ----- */

/* The config format this build reads; its presence also marks the library as
 * the simulator rather than a real driver's NVML. */
API unsigned int fakeNvmlConfigFormat(void)
{
    return CONFIG_FORMAT;
}

/* Why the last init or reload failed ("" after a successful load). */
API nvmlReturn_t fakeNvmlGetLastError(char *message, unsigned int length)
{
    char copy[sizeof st.last_error];
    pthread_mutex_lock(&st.lock);
    memcpy(copy, st.last_error, sizeof copy);
    pthread_mutex_unlock(&st.lock);
    return copy_string(message, length, copy);
}
