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
 *                                  hot-attached GPUs.  A MIG device is visible
 *                                  only while its GPU is and both its access
 *                                  nodes <dir>/nvidia-caps/nvidia-cap<N> (GPU
 *                                  and compute instance) are character devices.
 *                                  Re-evaluated by every count and handle
 *                                  lookup (no re-init needed).
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
 *                                   gives None), as NVML does in many containers;
 *                                   `pid:used_bytes:sm` adds the process's SM
 *                                   utilisation (percent, 0..100) to
 *                                   nvmlDeviceGetProcessUtilization (a process
 *                                   without it has no sample there)
 *     lost=0                        1: the GPU "fell off the bus": every query
 *                                   returns 15 (NVML_ERROR_GPU_IS_LOST)
 *     mig=unsupported               nvmlDeviceGetMigMode: unsupported (the
 *                                   default: NOT_SUPPORTED), disabled, enabled
 *     pcie_tx=0                     nvmlDeviceGetPcieThroughput, KB/s sent and
 *     pcie_rx=0                     received over PCIe (default 0)
 *     nvlinks=0                     NVLinks with throughput counters, 0..36; 0
 *                                   (the default): no NVLink, the NVLink fields
 *                                   of nvmlDeviceGetFieldValues are NOT_SUPPORTED
 *     nvlink_tx=0                   KiB/s sent and received over all NVLinks
 *     nvlink_rx=0                   together; more than 0 needs nvlinks
 *
 *     [mig]                         a MIG device of the [gpu] above (needs
 *                                   mig=enabled): one GPU instance with one
 *                                   compute instance spanning it
 *     uuid=MIG-...                  required, unique among all UUIDs
 *     profile=1g.10gb               required, <slices>g.<memory>gb, slices one
 *                                   of 1, 2, 3, 4, 7 (one profile per slice
 *                                   count on a GPU)
 *     gpu_instance_id=1             required, 0..14, unique on its GPU
 *     gi_access_minor=12            required: /dev/nvidia-caps/nvidia-cap<N>
 *     ci_access_minor=13            required   of the GI's and CI's access file
 *                                   (unique on the node, 0..2^20-1)
 *     compute_instance_id=0         0..7
 *     placement_start=0             0..7 (nvmlGpuInstanceGetInfo)
 *     name=...                      default "NVIDIA MIG <profile> (simulated)"
 *     memory_total=0                bytes; the GPU's MIG devices together hold
 *     memory_used=0                 at most its memory_total
 *     processes=...                 as for a GPU (without utilisation: NVML
 *                                   has no per-process samples on a MIG
 *                                   device); the GPU's own list adds them
 *
 *   GPUs are enumerated (NVML index) in file order among the visible ones;
 *   MIG devices (nvmlDeviceGetMigDeviceHandleByIndex) in file order among the
 *   visible ones of their GPU.  At most 64 GPUs, 7 MIG devices per GPU (as
 *   many slices), 64 processes per GPU or MIG device, 1 MiB of file.
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
 * MIG
 *
 *   A MIG device handle answers what real NVML answers for one: its UUID,
 *   name, memory, processes and instance ids, its parent GPU; metrics of the
 *   whole GPU (utilisation, temperature, power, PCI, minor) are NOT_SUPPORTED
 *   on it, as on hardware.  GPU and compute instance handles point into the
 *   MIG device's slot and share its lifetime.  Instance profile queries know
 *   the profiles that the GPU's MIG devices use (others are NOT_SUPPORTED);
 *   the profile ids are those of A100/H100 (1g 19, 2g 14, 3g 9, 4g 5, 7g 0).
 *   Creating or destroying instances and changing the MIG mode are not
 *   simulated: rewrite the config instead.
 *
 * PROCESS UTILISATION
 *
 *   nvmlDeviceGetProcessUtilization answers one sample per process that has an
 *   `sm` value, stamped with the config file's mtime (in microseconds since
 *   the epoch: a writer that moves the readings makes a new sample); memUtil
 *   is two thirds of smUtil, as the simulation's GPU-wide readings have it.
 *   No sample newer than the caller's timestamp: NOT_FOUND, as on hardware.
 *   A MIG device: NOT_SUPPORTED.
 *
 * NVLINK THROUGHPUT
 *
 *   nvmlDeviceGetFieldValues answers NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX
 *   (138, 139) as NVML does: a running count of KiB, for one link (scopeId <
 *   nvlinks) or all links together (scopeId UINT_MAX), with a timestamp in
 *   microseconds.  Readers turn two counts into a rate.  The library counts
 *   per GPU at the configured rates, from the GPU's first such query or config
 *   change, each rate for as long as it was in the config; one link's count is
 *   the total's share.  Other fields are NOT_SUPPORTED.
 *   Topology is not simulated: nvmlDeviceGetNvLinkState stays NOT_SUPPORTED
 *   for every GPU, so NVIDIA's device plugin sees the same board either way.
 *
 * All entry points are thread-safe (one mutex guards all state).
 * Not simulated: graphics processes (always none), every function not defined
 * here (pynvml then raises NVMLError_FunctionNotFound).
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
#include <time.h>
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

typedef struct {
    unsigned int start, size;
} nvmlInstancePlacement_t; /* nvmlGpuInstancePlacement_t and nvmlComputeInstancePlacement_t */

typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount;
    unsigned int copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount;
    unsigned int copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;
#define nvmlGpuInstanceProfileInfo_v2 NVML_STRUCT_VERSION(nvmlGpuInstanceProfileInfo_v2_t, 2)

struct nvmlDevice_st;
struct nvmlGpuInstance_st;
struct nvmlComputeInstance_st;
typedef struct nvmlGpuInstance_st *nvmlGpuInstance_t;
typedef struct nvmlComputeInstance_st *nvmlComputeInstance_t;

typedef struct {
    struct nvmlDevice_st *device;
    unsigned int id, profileId;
    nvmlInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    struct nvmlDevice_st *device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id, profileId;
    nvmlInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

/* What NVIDIA's k8s-device-plugin (go-nvlib) reads of a MIG device and of a GPU
 * instance's compute instance profiles to name its mixed-strategy resources. */
typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount;
    unsigned int sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    unsigned int gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount;
    unsigned int sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount;
    unsigned int sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[96];
} nvmlComputeInstanceProfileInfo_v2_t;
#define nvmlComputeInstanceProfileInfo_v2 NVML_STRUCT_VERSION(nvmlComputeInstanceProfileInfo_v2_t, 2)
#define NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT 0x1u

#define NVML_DEVICE_MIG_DISABLE 0u
#define NVML_DEVICE_MIG_ENABLE 1u
#define NVML_GPU_INSTANCE_PROFILE_COUNT 0x12u
#define NVML_COMPUTE_INSTANCE_PROFILE_COUNT 0x9u

/* nvmlFieldValue_t: one field of nvmlDeviceGetFieldValues. */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec; /* microseconds */
    int valueType;                    /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138u
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139u
#define NVML_PCIE_UTIL_TX_BYTES 0u
#define NVML_PCIE_UTIL_RX_BYTES 1u

_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout differs from pynvml");
_Static_assert(nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2_t layout differs from pynvml");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_t) == 48, "GPU instance profile info differs");
_Static_assert(nvmlGpuInstanceProfileInfo_v2 == 0x02000098u, "profile info v2 differs from pynvml");
_Static_assert(sizeof(nvmlGpuInstanceInfo_t) == 24, "nvmlGpuInstanceInfo_t differs from pynvml");
_Static_assert(sizeof(nvmlDeviceAttributes_t) == 40, "nvmlDeviceAttributes_t differs from pynvml");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_t) == 36, "CI profile info differs");
_Static_assert(nvmlComputeInstanceProfileInfo_v2 == 0x02000088u, "CI profile info v2 differs");
_Static_assert(sizeof(nvmlComputeInstanceInfo_t) == 32, "nvmlComputeInstanceInfo_t differs");
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
#define MAX_MIGS 7         /* MIG devices (and slices) per GPU */
#define MIG_SLICES 7u
#define PROFILE_LEN 32
#define MAX_GPU_INSTANCE_ID 14u
#define MAX_COMPUTE_INSTANCE_ID 7u
#define MAX_CAPS_MINOR ((1u << 20) - 1)
#define SIMULATED_SUFFIX " (simulated)"
#define MAX_NVLINKS 36u /* NVML_NVLINK_MAX_LINKS */

#define NO_SM_UTIL 0xFFFFFFFFu /* a process without a utilisation sample */

struct sim_process {
    unsigned int pid;
    unsigned long long used_memory;
    unsigned int sm_util; /* percent, or NO_SM_UTIL */
};

enum mig_mode { MIG_UNSUPPORTED, MIG_DISABLED, MIG_ENABLED };

struct mig_spec {
    char uuid[TEXT_LEN];
    char name[TEXT_LEN];
    char profile[PROFILE_LEN];
    unsigned int slices; /* from the profile */
    unsigned int gi_id, ci_id, placement_start, gi_minor, ci_minor;
    unsigned long long memory_total, memory_used;
    unsigned int nprocs;
    struct sim_process procs[MAX_PROCS];
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
    enum mig_mode mig_mode;
    unsigned int nmigs;
    struct mig_spec migs[MAX_MIGS];
    unsigned int pcie_tx, pcie_rx; /* KB/s */
    unsigned int nvlinks;
    unsigned long long nvlink_tx, nvlink_rx; /* KiB/s over all links */
};

struct sim_config {
    char driver_version[VERSION_LEN];
    unsigned int cuda_driver_version;
    unsigned int ngpus;
    struct gpu_spec gpus[MAX_GPUS];
};

/*
 * A device handle points at a slot.  Slots are created the first time a UUID
 * appears and are never freed, so a handle stays bound to its GPU (or MIG
 * device) across reloads and can always be validated by address.  A MIG
 * device's slot also holds its GPU and compute instance handles.
 */
struct nvmlGpuInstance_st {
    struct nvmlDevice_st *owner;
};
struct nvmlComputeInstance_st {
    struct nvmlDevice_st *owner;
};
struct nvmlDevice_st {
    struct gpu_spec spec; /* a GPU's; for a MIG device only spec.uuid is used */
    int present;          /* in the currently loaded config */
    int is_mig;
    struct nvmlDevice_st *parent; /* MIG device: its GPU's slot */
    struct mig_spec mig;
    struct nvmlGpuInstance_st gi;
    struct nvmlComputeInstance_st ci;
    /* NVLink KiB counted so far (TX, RX), up to nvlink_counted_at (CLOCK_MONOTONIC
     * seconds; 0: not counting yet).  Kept across reloads, like the handle. */
    double nvlink_kib[2];
    double nvlink_counted_at;
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

static int parse_processes(struct parser *p, struct sim_process *procs, unsigned int *nprocs,
                           char *value, int with_util)
{
    *nprocs = 0;
    if (*value == '\0')
        return 0;
    for (char *rest = value, *tok; (tok = strsep(&rest, ",")) != NULL;) {
        tok = trim(tok);
        char *colon = strchr(tok, ':');
        if (!colon)
            return parse_fail(p, "process %s: expected pid:used_bytes", tok);
        *colon = '\0';
        char *util_colon = strchr(colon + 1, ':');
        unsigned int sm = NO_SM_UTIL;
        if (util_colon) {
            *util_colon = '\0';
            if (!with_util)
                return parse_fail(p, "process %s: a MIG device's process has no utilisation", tok);
            if (parse_uint(trim(util_colon + 1), 100, &sm) != 0)
                return parse_fail(p, "process %s: utilisation %s: expected 0..100", tok,
                                  trim(util_colon + 1));
        }
        unsigned int pid;
        unsigned long long used = NVML_VALUE_NOT_AVAILABLE_ULL;
        const char *used_text = trim(colon + 1);
        if (parse_uint(trim(tok), UINT_MAX, &pid) != 0 || pid == 0 ||
            (strcmp(used_text, "na") != 0 && parse_ull(used_text, 10, ULLONG_MAX - 1, &used) != 0))
            return parse_fail(p, "process %s:%s: expected pid:used_bytes or pid:na", tok, used_text);
        if (*nprocs == MAX_PROCS)
            return parse_fail(p, "more than %d processes", MAX_PROCS);
        procs[*nprocs].pid = pid;
        procs[*nprocs].used_memory = used;
        procs[*nprocs].sm_util = sm;
        (*nprocs)++;
    }
    return 0;
}

enum gpu_key {
    K_UUID, K_MINOR, K_NAME, K_PCI_BUS_ID, K_PCI_DEVICE_ID, K_MEMORY_TOTAL, K_MEMORY_USED,
    K_UTILIZATION_GPU, K_UTILIZATION_MEMORY, K_TEMPERATURE, K_POWER_USAGE, K_POWER_LIMIT,
    K_COMPUTE_CAPABILITY, K_PROCESSES, K_LOST, K_MIG, K_PCIE_TX, K_PCIE_RX, K_NVLINKS,
    K_NVLINK_TX, K_NVLINK_RX, K_GPU_KEY_COUNT
};
static const char *const gpu_keys[K_GPU_KEY_COUNT] = {
    "uuid", "minor", "name", "pci_bus_id", "pci_device_id", "memory_total", "memory_used",
    "utilization_gpu", "utilization_memory", "temperature", "power_usage", "power_limit",
    "compute_capability", "processes", "lost", "mig", "pcie_tx", "pcie_rx", "nvlinks",
    "nvlink_tx", "nvlink_rx",
};

enum mig_key {
    M_UUID, M_PROFILE, M_GPU_INSTANCE_ID, M_COMPUTE_INSTANCE_ID, M_PLACEMENT_START,
    M_GI_ACCESS_MINOR, M_CI_ACCESS_MINOR, M_NAME, M_MEMORY_TOTAL, M_MEMORY_USED, M_PROCESSES,
    M_MIG_KEY_COUNT
};
static const char *const mig_keys[M_MIG_KEY_COUNT] = {
    "uuid", "profile", "gpu_instance_id", "compute_instance_id", "placement_start",
    "gi_access_minor", "ci_access_minor", "name", "memory_total", "memory_used", "processes",
};
static const char *const mig_modes[] = {"unsupported", "disabled", "enabled"};

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
        return parse_processes(p, g->procs, &g->nprocs, value, 1);
    case K_LOST:
        if (parse_bool(value, &g->lost) != 0)
            return parse_fail(p, "lost %s: expected 0 or 1", value);
        return 0;
    case K_MIG:
        for (unsigned int i = 0; i < sizeof mig_modes / sizeof *mig_modes; i++)
            if (strcmp(value, mig_modes[i]) == 0) {
                g->mig_mode = (enum mig_mode)i;
                return 0;
            }
        return parse_fail(p, "mig %s: expected unsupported, disabled or enabled", value);
    case K_PCIE_TX:
        uint_field = &g->pcie_tx;
        break;
    case K_PCIE_RX:
        uint_field = &g->pcie_rx;
        break;
    case K_NVLINKS:
        uint_field = &g->nvlinks;
        uint_max = MAX_NVLINKS;
        break;
    case K_NVLINK_TX:
    case K_NVLINK_RX:
        if (parse_ull(value, 10, ULLONG_MAX, k == K_NVLINK_TX ? &g->nvlink_tx : &g->nvlink_rx) != 0)
            return parse_fail(p, "%s %s: expected KiB/s", gpu_keys[k], value);
        return 0;
    case K_GPU_KEY_COUNT:
        break;
    }
    if (!uint_field || parse_uint(value, uint_max, uint_field) != 0)
        return parse_fail(p, "%s %s: expected a whole number from 0 to %u", gpu_keys[k], value,
                          uint_max);
    return 0;
}

/* "<slices>g.<gigabytes>gb": slices one of 1, 2, 3, 4, 7; gigabytes 1..9999 without a
 * leading zero (the simulator's profile names, as config.py checks them). */
static int parse_profile(const char *s, unsigned int *slices)
{
    if (s[0] < '1' || s[0] > '9' || s[1] != 'g' || s[2] != '.' || s[3] < '1' || s[3] > '9')
        return -1;
    size_t digits = strspn(s + 3, "0123456789");
    if (digits > 4 || strcmp(s + 3 + digits, "gb") != 0)
        return -1;
    *slices = (unsigned int)(s[0] - '0');
    return *slices == 5 || *slices == 6 || *slices > 7 ? -1 : 0;
}

static int set_mig_key(struct parser *p, struct mig_spec *m, enum mig_key k, char *value)
{
    unsigned int *uint_field = NULL;
    unsigned int uint_max = UINT_MAX;
    switch (k) {
    case M_UUID:
        if (strncmp(value, "MIG-", 4) != 0)
            return parse_fail(p, "MIG uuid %s must start with MIG-", value);
        return set_text(p, m->uuid, "uuid", value);
    case M_NAME:
        return set_text(p, m->name, "name", value);
    case M_PROFILE:
        if (parse_profile(value, &m->slices) != 0)
            return parse_fail(p, "profile %s: expected <slices>g.<memory>gb with slices one of 1, "
                                 "2, 3, 4, 7", value);
        snprintf(m->profile, sizeof m->profile, "%s", value);
        return 0;
    case M_GPU_INSTANCE_ID:
        uint_field = &m->gi_id;
        uint_max = MAX_GPU_INSTANCE_ID;
        break;
    case M_COMPUTE_INSTANCE_ID:
        uint_field = &m->ci_id;
        uint_max = MAX_COMPUTE_INSTANCE_ID;
        break;
    case M_PLACEMENT_START:
        uint_field = &m->placement_start;
        uint_max = 7;
        break;
    case M_GI_ACCESS_MINOR:
        uint_field = &m->gi_minor;
        uint_max = MAX_CAPS_MINOR;
        break;
    case M_CI_ACCESS_MINOR:
        uint_field = &m->ci_minor;
        uint_max = MAX_CAPS_MINOR;
        break;
    case M_MEMORY_TOTAL:
    case M_MEMORY_USED:
        if (parse_ull(value, 10, ULLONG_MAX,
                      k == M_MEMORY_TOTAL ? &m->memory_total : &m->memory_used) != 0)
            return parse_fail(p, "%s %s: expected bytes", mig_keys[k], value);
        return 0;
    case M_PROCESSES:
        return parse_processes(p, m->procs, &m->nprocs, value, 0);
    case M_MIG_KEY_COUNT:
        break;
    }
    if (!uint_field || parse_uint(value, uint_max, uint_field) != 0)
        return parse_fail(p, "%s %s: expected a whole number from 0 to %u", mig_keys[k], value,
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

/* Checks that need the whole MIG section. */
static int finish_mig(struct parser *p, struct mig_spec *m, unsigned int seen, unsigned int line)
{
    unsigned int here = p->line;
    p->line = line; /* errors name the section's first line */
    static const enum mig_key required[] = {M_UUID, M_PROFILE, M_GPU_INSTANCE_ID,
                                            M_GI_ACCESS_MINOR, M_CI_ACCESS_MINOR};
    for (size_t i = 0; i < sizeof required / sizeof *required; i++)
        if (!(seen & (1u << required[i])))
            return parse_fail(p, "MIG section without %s", mig_keys[required[i]]);
    if (m->gi_minor == m->ci_minor)
        return parse_fail(p, "MIG %s: the GI and CI access minors are equal", m->uuid);
    if (m->memory_used > m->memory_total)
        return parse_fail(p, "MIG %s: memory_used exceeds memory_total", m->uuid);
    if (!(seen & (1u << M_NAME)))
        snprintf(m->name, sizeof m->name, "NVIDIA MIG %s" SIMULATED_SUFFIX, m->profile);
    p->line = here;
    return 0;
}

/* Checks that need the whole GPU section, its MIG sections included. */
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
    if (g->nmigs && g->mig_mode != MIG_ENABLED)
        return parse_fail(p, "GPU %s has MIG devices but mig=%s", g->uuid, mig_modes[g->mig_mode]);
    if (!g->nvlinks && (g->nvlink_tx || g->nvlink_rx))
        return parse_fail(p, "GPU %s has NVLink traffic but nvlinks=0", g->uuid);
    unsigned int slices = 0;
    unsigned long long memory = 0;
    for (unsigned int i = 0; i < g->nmigs; i++) {
        const struct mig_spec *m = &g->migs[i];
        slices += m->slices;
        memory += m->memory_total;
        if (memory < m->memory_total || memory > g->memory_total)
            return parse_fail(p, "GPU %s: MIG devices hold more than its memory", g->uuid);
        for (unsigned int j = 0; j < i; j++) {
            if (g->migs[j].gi_id == m->gi_id)
                return parse_fail(p, "GPU %s: a gpu_instance_id appears twice", g->uuid);
            if (g->migs[j].slices == m->slices && strcmp(g->migs[j].profile, m->profile) != 0)
                return parse_fail(p, "GPU %s: profiles %s and %s have the same slice count (one "
                                     "profile per slice count is simulated)",
                                  g->uuid, g->migs[j].profile, m->profile);
        }
    }
    if (slices > MIG_SLICES)
        return parse_fail(p, "GPU %s: MIG devices use more than 7 slices", g->uuid);
    return 0;
}

/* Whether a MIG device before gpus[gi].migs[mi] (in file order) has `uuid` or
 * uses caps minor `minor`. */
static int mig_clash(const struct sim_config *cfg, unsigned int gi, unsigned int mi,
                     const char *uuid, unsigned int minor)
{
    for (unsigned int i = 0; i <= gi; i++)
        for (unsigned int j = 0; j < (i == gi ? mi : cfg->gpus[i].nmigs); j++) {
            const struct mig_spec *m = &cfg->gpus[i].migs[j];
            if ((uuid && strcmp(m->uuid, uuid) == 0) || m->gi_minor == minor || m->ci_minor == minor)
                return 1;
        }
    return 0;
}

static int check_unique(struct parser *p, const struct sim_config *cfg)
{
    p->line = 0;
    for (unsigned int i = 0; i < cfg->ngpus; i++)
        for (unsigned int j = 0; j < i; j++) {
            if (strcmp(cfg->gpus[i].uuid, cfg->gpus[j].uuid) == 0)
                return parse_fail(p, "uuid appears twice: %s", cfg->gpus[i].uuid);
            if (cfg->gpus[i].minor == cfg->gpus[j].minor)
                return parse_fail(p, "minor appears twice: %u", cfg->gpus[i].minor);
        }
    for (unsigned int i = 0; i < cfg->ngpus; i++)
        for (unsigned int j = 0; j < cfg->gpus[i].nmigs; j++) {
            const struct mig_spec *m = &cfg->gpus[i].migs[j];
            for (unsigned int k = 0; k < cfg->ngpus; k++)
                if (strcmp(cfg->gpus[k].uuid, m->uuid) == 0)
                    return parse_fail(p, "uuid appears twice: %s", m->uuid);
            if (mig_clash(cfg, i, j, m->uuid, UINT_MAX))
                return parse_fail(p, "uuid appears twice: %s", m->uuid);
            if (mig_clash(cfg, i, j, NULL, m->gi_minor))
                return parse_fail(p, "nvidia-caps minor appears twice: %u", m->gi_minor);
            if (mig_clash(cfg, i, j, NULL, m->ci_minor))
                return parse_fail(p, "nvidia-caps minor appears twice: %u", m->ci_minor);
        }
    return 0;
}

/* Parse `text` (modified in place) into `cfg`; on failure write the reason to `err`. */
static int parse_config(char *text, const char *path, struct sim_config *cfg, char *err, size_t errlen)
{
    struct parser p = {.path = path, .err = err, .errlen = errlen};
    struct gpu_spec *gpu = NULL;
    struct mig_spec *mig = NULL;  /* the current section is this [mig] of `gpu` */
    unsigned int seen = 0;        /* keys seen in the current GPU section, as bits */
    unsigned int mig_seen = 0;    /* ... and in the current MIG section */
    unsigned int gpu_line = 0;    /* where the current GPU section starts */
    unsigned int mig_line = 0;    /* ... and the current MIG section */
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
            int is_gpu = strcmp(line, "[gpu]") == 0;
            if (!is_gpu && strcmp(line, "[mig]") != 0)
                return parse_fail(&p, "unknown section %s", line);
            if (mig && finish_mig(&p, mig, mig_seen, mig_line) != 0)
                return -1;
            mig = NULL;
            if (!is_gpu) {
                if (!gpu)
                    return parse_fail(&p, "a [mig] section must follow the [gpu] it belongs to");
                if (gpu->nmigs == MAX_MIGS)
                    return parse_fail(&p, "GPU %s: more than %d MIG devices", gpu->uuid, MAX_MIGS);
                mig = &gpu->migs[gpu->nmigs++];
                memset(mig, 0, sizeof *mig);
                mig_seen = 0;
                mig_line = p.line;
                continue;
            }
            if (gpu) {
                unsigned int here = p.line;
                p.line = gpu_line;
                if (finish_gpu(&p, gpu, seen) != 0)
                    return -1;
                p.line = here;
            }
            if (cfg->ngpus == MAX_GPUS)
                return parse_fail(&p, "more than %d GPUs", MAX_GPUS);
            gpu = &cfg->gpus[cfg->ngpus++];
            gpu_defaults(gpu);
            seen = 0;
            gpu_line = p.line;
            continue;
        }
        char *eq = strchr(line, '=');
        if (!eq)
            return parse_fail(&p, "expected key=value, [gpu] or [mig]");
        *eq = '\0';
        char *key = trim(line), *value = trim(eq + 1);
        unsigned int *bits = mig ? &mig_seen : &seen;
        int k = mig   ? lookup_key(mig_keys, M_MIG_KEY_COUNT, key)
                : gpu ? lookup_key(gpu_keys, K_GPU_KEY_COUNT, key)
                      : lookup_key(global_keys, G_KEY_COUNT, key);
        if (k < 0)
            return parse_fail(&p, "unknown %s key %s", mig ? "MIG" : gpu ? "GPU" : "global", key);
        if (*bits & (1u << k))
            return parse_fail(&p, "%s given twice", key);
        *bits |= 1u << k;
        int rc = mig   ? set_mig_key(&p, mig, (enum mig_key)k, value)
                 : gpu ? set_gpu_key(&p, gpu, (enum gpu_key)k, value)
                       : set_global_key(&p, cfg, (enum global_key)k, value);
        if (rc != 0)
            return -1;
    }
    if (!have_version)
        return parse_fail(&p, "no version=%u line (is this a fake NVML config?)", CONFIG_FORMAT);
    if (mig && finish_mig(&p, mig, mig_seen, mig_line) != 0)
        return -1;
    if (gpu) {
        p.line = gpu_line;
        if (finish_gpu(&p, gpu, seen) != 0)
            return -1;
    }
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
    d->gi.owner = d;
    d->ci.owner = d;
    st.slots[st.nslots++] = d;
    return 0;
}

static double clock_seconds(clockid_t clock)
{
    struct timespec now;
    clock_gettime(clock, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

/* Bring a GPU's NVLink counts up to now, at its configured rates. */
static void count_nvlink_locked(nvmlDevice_t d)
{
    double now = clock_seconds(CLOCK_MONOTONIC);
    if (d->nvlink_counted_at > 0) {
        double elapsed = now - d->nvlink_counted_at;
        d->nvlink_kib[0] += (double)d->spec.nvlink_tx * elapsed;
        d->nvlink_kib[1] += (double)d->spec.nvlink_rx * elapsed;
    }
    d->nvlink_counted_at = now;
}

/* Make `cfg` the current state.  All allocation happens before anything
 * changes, so running out of memory leaves the previous state intact. */
static nvmlReturn_t commit_locked(const struct sim_config *cfg)
{
    for (unsigned int i = 0; i < cfg->ngpus; i++) {
        const struct gpu_spec *g = &cfg->gpus[i];
        if (!find_slot_locked(g->uuid) && add_slot_locked(g->uuid) != 0)
            return NVML_ERROR_MEMORY;
        for (unsigned int j = 0; j < g->nmigs; j++)
            if (!find_slot_locked(g->migs[j].uuid) && add_slot_locked(g->migs[j].uuid) != 0)
                return NVML_ERROR_MEMORY;
    }
    for (unsigned int i = 0; i < st.nslots; i++) {
        if (st.slots[i]->present && !st.slots[i]->is_mig)
            count_nvlink_locked(st.slots[i]); /* up to now at the old rates */
        st.slots[i]->present = 0;
    }
    for (unsigned int i = 0; i < cfg->ngpus; i++) {
        nvmlDevice_t d = find_slot_locked(cfg->gpus[i].uuid);
        d->spec = cfg->gpus[i];
        d->present = 1;
        d->is_mig = 0;
        d->parent = NULL;
        st.order[i] = d;
        for (unsigned int j = 0; j < d->spec.nmigs; j++) {
            nvmlDevice_t m = find_slot_locked(d->spec.migs[j].uuid);
            m->mig = d->spec.migs[j];
            m->present = 1;
            m->is_mig = 1;
            m->parent = d;
        }
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

/* Whether <filter dir>/<prefix><minor> is a character device. */
static int char_node_exists(const char *prefix, unsigned int minor)
{
    char path[PATH_MAX + 64];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s%u", st.filter_dir, prefix, minor);
    return stat(path, &sb) == 0 && S_ISCHR(sb.st_mode);
}

/* The container view: with a filter, only GPUs whose node exists are visible,
 * and only MIG devices of visible GPUs whose two access nodes exist. */
static int visible_locked(nvmlDevice_t d)
{
    if (!d->present)
        return 0;
    if (d->is_mig)
        return visible_locked(d->parent) &&
               (!st.filtered || (char_node_exists("nvidia-caps/nvidia-cap", d->mig.gi_minor) &&
                                 char_node_exists("nvidia-caps/nvidia-cap", d->mig.ci_minor)));
    return !st.filtered || char_node_exists("nvidia", d->spec.minor);
}

/* The visible MIG devices of GPU `d`, in file order. */
static unsigned int visible_migs_locked(nvmlDevice_t d, nvmlDevice_t out[MAX_MIGS])
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < d->spec.nmigs; i++) {
        nvmlDevice_t m = find_slot_locked(d->spec.migs[i].uuid);
        if (m && m->parent == d && visible_locked(m))
            out[n++] = m;
    }
    return n;
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

/* Any valid handle, GPU or MIG device, whose GPU is present and not lost. */
static nvmlReturn_t check_handle_locked(nvmlDevice_t d)
{
    if (!d || !is_slot_locked(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->present || (d->is_mig ? d->parent->spec.lost : d->spec.lost))
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* Copy one GPU's state out, so callers fill NVML structures without the lock.
 * A MIG device handle gets NOT_SUPPORTED: whole-GPU queries do not apply to it. */
static nvmlReturn_t snapshot(nvmlDevice_t d, struct gpu_spec *out)
{
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(d);
    if (rc == NVML_SUCCESS && d->is_mig)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *out = d->spec;
    leave();
    return rc;
}

/* The state of handle `d` as a MIG device (`is_mig` says whether it is one),
 * copied out like snapshot(); `parent` (optional) receives its GPU's handle. */
static nvmlReturn_t device_snapshot(nvmlDevice_t d, int *is_mig, struct gpu_spec *gpu,
                                    struct mig_spec *mig, nvmlDevice_t *parent)
{
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(d);
    if (rc == NVML_SUCCESS) {
        *is_mig = d->is_mig;
        if (d->is_mig && mig)
            *mig = d->mig;
        if (!d->is_mig && gpu)
            *gpu = d->spec;
        if (parent)
            *parent = d->parent;
    }
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
    /* MIG UUIDs are accepted too (R470 and later). */
    nvmlDevice_t mig = rc == NVML_ERROR_NOT_FOUND ? find_slot_locked(uuid) : NULL;
    if (mig && mig->is_mig && visible_locked(mig)) {
        rc = mig->parent->spec.lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
        if (rc == NVML_SUCCESS)
            *device = mig;
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
    if (rc == NVML_SUCCESS && device->is_mig)
        rc = NVML_ERROR_NOT_SUPPORTED;
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

/* Text of a GPU or a MIG device: `gpu_text`/`mig_text` point into the spec. */
static nvmlReturn_t get_text(nvmlDevice_t device, char *dst, unsigned int length, size_t gpu_text,
                             size_t mig_text)
{
    int is_mig;
    struct gpu_spec g;
    struct mig_spec m;
    nvmlReturn_t rc = device_snapshot(device, &is_mig, &g, &m, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    return copy_string(dst, length, is_mig ? (const char *)&m + mig_text : (const char *)&g + gpu_text);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    return get_text(device, name, length, offsetof(struct gpu_spec, name),
                    offsetof(struct mig_spec, name));
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    return get_text(device, uuid, length, offsetof(struct gpu_spec, uuid),
                    offsetof(struct mig_spec, uuid));
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    return get_uint(device, minor, offsetof(struct gpu_spec, minor));
}

/* Total and used bytes of a GPU, or of a MIG device (its slice's memory). */
static nvmlReturn_t get_memory(nvmlDevice_t device, unsigned long long *total,
                               unsigned long long *used)
{
    int is_mig;
    struct gpu_spec g;
    struct mig_spec m;
    nvmlReturn_t rc = device_snapshot(device, &is_mig, &g, &m, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    *total = is_mig ? m.memory_total : g.memory_total;
    *used = is_mig ? m.memory_used : g.memory_used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned long long total, used;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = get_memory(device, &total, &used);
    if (rc != NVML_SUCCESS)
        return rc;
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    unsigned long long total, used;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = get_memory(device, &total, &used);
    if (rc != NVML_SUCCESS)
        return rc;
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
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

API nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter,
                                             unsigned int *value)
{
    if (counter == NVML_PCIE_UTIL_TX_BYTES)
        return get_uint(device, value, offsetof(struct gpu_spec, pcie_tx));
    if (counter == NVML_PCIE_UTIL_RX_BYTES)
        return get_uint(device, value, offsetof(struct gpu_spec, pcie_rx));
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* One field of a whole GPU; `is_mig`: the handle is a MIG device's. */
static void field_value_locked(nvmlDevice_t d, int is_mig, long long timestamp,
                               nvmlFieldValue_t *field)
{
    field->timestamp = timestamp;
    field->latencyUsec = 0;
    field->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    field->value.ullVal = 0;
    int direction = field->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX   ? 0
                    : field->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX ? 1
                                                                               : -1;
    if (direction < 0 || is_mig || d->spec.nvlinks == 0) {
        field->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    if (field->scopeId != UINT_MAX && field->scopeId >= d->spec.nvlinks) {
        field->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return;
    }
    double kib = d->nvlink_kib[direction];
    if (field->scopeId != UINT_MAX)
        kib /= d->spec.nvlinks;
    field->value.ullVal = (unsigned long long)kib;
    field->nvmlReturn = NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values)
{
    if (count < 0 || (count > 0 && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(device);
    if (rc == NVML_SUCCESS) {
        long long timestamp = (long long)(clock_seconds(CLOCK_REALTIME) * 1e6);
        if (!device->is_mig)
            count_nvlink_locked(device);
        for (int i = 0; i < count; i++)
            field_value_locked(device, device->is_mig, timestamp, &values[i]);
    }
    leave();
    return rc;
}

/* Append `n` processes to infos[*at...] (only counted when `infos` is NULL);
 * `mig` names the MIG device they run in, or is NULL. */
static void add_processes(nvmlProcessInfo_t *infos, unsigned int *at, const struct sim_process *procs,
                          unsigned int n, const struct mig_spec *mig)
{
    for (unsigned int i = 0; i < n; i++, (*at)++) {
        if (!infos)
            continue;
        infos[*at].pid = procs[i].pid;
        infos[*at].usedGpuMemory = procs[i].used_memory;
        infos[*at].gpuInstanceId = mig ? mig->gi_id : NVML_VALUE_NOT_AVAILABLE_UINT;
        infos[*at].computeInstanceId = mig ? mig->ci_id : NVML_VALUE_NOT_AVAILABLE_UINT;
    }
}

/* NVML's two-call protocol: a short buffer gets INSUFFICIENT_SIZE and the
 * needed count; no processes is SUCCESS with a count of 0.  A GPU lists its
 * own processes and those of its MIG devices; a MIG device lists its own. */
static nvmlReturn_t get_processes(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos,
                                  int graphics)
{
    int is_mig;
    struct gpu_spec g;
    struct mig_spec m;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_snapshot(device, &is_mig, &g, &m, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    /* Two passes over the same lists: count, then (with room enough) fill. */
    unsigned int n = 0;
    for (int fill = 0; fill < 2 && !graphics; fill++) {
        nvmlProcessInfo_t *out = fill ? infos : NULL;
        if (fill && (n == 0 || !infos || *count < n))
            break;
        n = 0;
        if (is_mig) {
            add_processes(out, &n, m.procs, m.nprocs, &m);
            continue;
        }
        add_processes(out, &n, g.procs, g.nprocs, NULL);
        for (unsigned int i = 0; i < g.nmigs; i++)
            add_processes(out, &n, g.migs[i].procs, g.migs[i].nprocs, &g.migs[i]);
    }
    if (n > 0 && (!infos || *count < n)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
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

/* nvmlProcessUtilizationSample_t */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

/* When the loaded config's readings were taken (its mtime), in microseconds
 * since the epoch. */
static unsigned long long sample_time_us(void)
{
    pthread_mutex_lock(&st.lock);
    struct timespec taken = st.loaded.st_mtim;
    pthread_mutex_unlock(&st.lock);
    return (unsigned long long)taken.tv_sec * 1000000ull + (unsigned long long)taken.tv_nsec / 1000ull;
}

/* One sample per process of the GPU that has a utilisation, stamped with the
 * config's mtime; NVML's two-call protocol as for the process lists. */
API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                 nvmlProcessUtilizationSample_t *utilization,
                                                 unsigned int *count,
                                                 unsigned long long lastSeenTimeStamp)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    unsigned long long stamp = sample_time_us();
    unsigned int n = 0;
    for (unsigned int i = 0; i < g.nprocs; i++)
        n += g.procs[i].sm_util != NO_SM_UTIL;
    if (n == 0 || stamp <= lastSeenTimeStamp) {
        *count = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!utilization || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int at = 0;
    for (unsigned int i = 0; i < g.nprocs; i++) {
        if (g.procs[i].sm_util == NO_SM_UTIL)
            continue;
        utilization[at].pid = g.procs[i].pid;
        utilization[at].timeStamp = stamp;
        utilization[at].smUtil = g.procs[i].sm_util;
        utilization[at].memUtil = g.procs[i].sm_util * 2 / 3;
        utilization[at].encUtil = 0;
        utilization[at].decUtil = 0;
        at++;
    }
    *count = n;
    return NVML_SUCCESS;
}

/* ----- topology ----- */

/* What NVIDIA's device plugin asks (through go-gpuallocator) before it prefers devices for a
 * pod: every pair's common ancestor and each GPU's NVLinks. Simulated GPUs sit under one CPU
 * (NVML_TOPOLOGY_NODE) and have no NVLink (NOT_SUPPORTED, as on PCIe boards). */
#define NVML_TOPOLOGY_NODE 40u
#define NVML_NVLINK_MAX_LINKS 36u /* nvml.h since Blackwell (go-nvml still walks 18) */

static nvmlReturn_t whole_gpu(nvmlDevice_t device)
{
    WITH_GPU(device, g);
    (void)g;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t first, nvmlDevice_t second,
                                                     unsigned int *level)
{
    if (!level)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = whole_gpu(first);
    if (rc == NVML_SUCCESS)
        rc = whole_gpu(second);
    if (rc == NVML_SUCCESS)
        *level = NVML_TOPOLOGY_NODE;
    return rc;
}

static nvmlReturn_t no_nvlink(nvmlDevice_t device, unsigned int link, const void *out)
{
    if (!out || link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = whole_gpu(device);
    return rc == NVML_SUCCESS ? NVML_ERROR_NOT_SUPPORTED : rc;
}

API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *active)
{
    return no_nvlink(device, link, active);
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                     nvmlPciInfo_t *pci)
{
    return no_nvlink(device, link, pci);
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
                                                  nvmlPciInfo_t *pci)
{
    return no_nvlink(device, link, pci);
}

/* ----- MIG ----- */

/* GPU instance profiles by slice count: NVML's profile enum (what
 * nvmlDeviceGetGpuInstanceProfileInfo takes) and the profile id it reports
 * (what nvidia-smi lists and instance infos carry), as on A100 and H100.
 * Compute instance profiles use the same enum values. */
static const struct {
    unsigned int slices, profile, id;
} mig_profiles[] = {{1, 0, 19}, {2, 1, 14}, {3, 2, 9}, {4, 3, 5}, {7, 4, 0}};

static unsigned int profile_enum(unsigned int slices)
{
    for (size_t i = 0; i < sizeof mig_profiles / sizeof *mig_profiles; i++)
        if (mig_profiles[i].slices == slices)
            return mig_profiles[i].profile;
    return UINT_MAX; /* unreachable: the parser admits only these slice counts */
}

static unsigned int profile_id(unsigned int slices)
{
    for (size_t i = 0; i < sizeof mig_profiles / sizeof *mig_profiles; i++)
        if (mig_profiles[i].slices == slices)
            return mig_profiles[i].id;
    return UINT_MAX;
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    if (g.mig_mode == MIG_UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = g.mig_mode == MIG_ENABLED ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

/* Zero unless MIG is enabled, as NVML documents. */
API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    *count = g.mig_mode == MIG_ENABLED ? MAX_MIGS : 0;
    return NVML_SUCCESS;
}

/* Indices below the maximum that hold no (visible) MIG device are NOT_FOUND,
 * which is what callers that walk 0..max-1 expect. */
API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *mig)
{
    nvmlDevice_t visible[MAX_MIGS];
    if (!mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(device);
    if (rc == NVML_SUCCESS && (device->is_mig || device->spec.mig_mode != MIG_ENABLED))
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (rc == NVML_SUCCESS && index >= MAX_MIGS)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        unsigned int n = visible_migs_locked(device, visible);
        if (index < n)
            *mig = visible[index];
        else
            rc = NVML_ERROR_NOT_FOUND;
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig)
{
    int mig;
    if (!is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_snapshot(device, &mig, NULL, NULL, NULL);
    if (rc == NVML_SUCCESS)
        *is_mig = (unsigned int)mig;
    return rc;
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device)
{
    int is_mig;
    nvmlDevice_t parent;
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_snapshot(mig, &is_mig, NULL, NULL, &parent);
    if (rc == NVML_SUCCESS && !is_mig)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *device = parent;
    return rc;
}

/* An instance id of a MIG device; NOT_SUPPORTED for a GPU handle. */
static nvmlReturn_t get_instance_id(nvmlDevice_t device, unsigned int *id, int compute)
{
    int is_mig;
    struct mig_spec m;
    if (!id)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_snapshot(device, &is_mig, NULL, &m, NULL);
    if (rc == NVML_SUCCESS && !is_mig)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *id = compute ? m.ci_id : m.gi_id;
    return rc;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return get_instance_id(device, id, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return get_instance_id(device, id, 1);
}

/* Fill a v1 profile info from a MIG device that uses the profile. */
static void fill_profile_info(nvmlGpuInstanceProfileInfo_t *info, const struct mig_spec *m)
{
    memset(info, 0, sizeof *info);
    info->id = profile_id(m->slices);
    info->sliceCount = m->slices;
    info->instanceCount = MIG_SLICES / m->slices;
    info->multiprocessorCount = 16 * m->slices;
    info->copyEngineCount = m->slices;
    info->memorySizeMB = m->memory_total >> 20;
}

/* The profile info of GPU `device` for profile enum `profile`, from one of its
 * MIG devices that uses it; `name` gets "MIG <profile>". */
static nvmlReturn_t get_profile_info(nvmlDevice_t device, unsigned int profile,
                                     nvmlGpuInstanceProfileInfo_t *info, char *name, size_t len)
{
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    WITH_GPU(device, g);
    if (g.mig_mode == MIG_UNSUPPORTED)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < g.nmigs; i++)
        if (profile_enum(g.migs[i].slices) == profile) {
            fill_profile_info(info, &g.migs[i]);
            snprintf(name, len, "MIG %s", g.migs[i].profile);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                     nvmlGpuInstanceProfileInfo_t *info)
{
    char name[TEXT_LEN];
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    return get_profile_info(device, profile, info, name, sizeof name);
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                      nvmlGpuInstanceProfileInfo_v2_t *info)
{
    nvmlGpuInstanceProfileInfo_t v1;
    char name[TEXT_LEN];
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlGpuInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = get_profile_info(device, profile, &v1, name, sizeof name);
    if (rc != NVML_SUCCESS)
        return rc;
    info->id = v1.id;
    info->isP2pSupported = v1.isP2pSupported;
    info->sliceCount = v1.sliceCount;
    info->instanceCount = v1.instanceCount;
    info->multiprocessorCount = v1.multiprocessorCount;
    info->copyEngineCount = v1.copyEngineCount;
    info->decoderCount = v1.decoderCount;
    info->encoderCount = v1.encoderCount;
    info->jpegCount = v1.jpegCount;
    info->ofaCount = v1.ofaCount;
    info->memorySizeMB = v1.memorySizeMB;
    snprintf(info->name, sizeof info->name, "%s", name);
    return NVML_SUCCESS;
}

/* The GPU's visible MIG device whose GPU instance matches; lock held. */
static nvmlReturn_t find_instance_locked(nvmlDevice_t device, unsigned int gi_id, nvmlDevice_t *out)
{
    nvmlDevice_t visible[MAX_MIGS];
    nvmlReturn_t rc = check_handle_locked(device);
    if (rc == NVML_SUCCESS && (device->is_mig || device->spec.mig_mode != MIG_ENABLED))
        return NVML_ERROR_NOT_SUPPORTED;
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int n = visible_migs_locked(device, visible);
    for (unsigned int i = 0; i < n; i++)
        if (visible[i]->mig.gi_id == gi_id) {
            *out = visible[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                              nvmlGpuInstance_t *instance)
{
    nvmlDevice_t mig;
    if (!instance)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = find_instance_locked(device, id, &mig);
    if (rc == NVML_SUCCESS)
        *instance = &mig->gi;
    leave();
    return rc;
}

/* NVML sizes the array by the profile's instance count; so does the caller. */
API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profile_id_wanted,
                                           nvmlGpuInstance_t *instances, unsigned int *count)
{
    nvmlDevice_t visible[MAX_MIGS];
    if (!instances || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = check_handle_locked(device);
    if (rc == NVML_SUCCESS && (device->is_mig || device->spec.mig_mode != MIG_ENABLED))
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS) {
        unsigned int n = visible_migs_locked(device, visible), found = 0;
        for (unsigned int i = 0; i < n; i++)
            if (profile_id(visible[i]->mig.slices) == profile_id_wanted)
                instances[found++] = &visible[i]->gi;
        *count = found;
    }
    leave();
    return rc;
}

/* The MIG device slot behind a GPU (compute: 0) or compute instance handle,
 * if that handle is valid and its device present; lock held. */
static nvmlReturn_t instance_owner_locked(const void *instance, int compute, nvmlDevice_t *out)
{
    for (unsigned int i = 0; i < st.nslots; i++) {
        nvmlDevice_t d = st.slots[i];
        if (instance != (compute ? (const void *)&d->ci : (const void *)&d->gi))
            continue;
        if (!d->is_mig || !d->present)
            return NVML_ERROR_INVALID_ARGUMENT; /* destroyed: the handle is stale */
        if (d->parent->spec.lost)
            return NVML_ERROR_GPU_IS_LOST;
        *out = d;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

API nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t instance, nvmlGpuInstanceInfo_t *info)
{
    nvmlDevice_t d;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = instance_owner_locked(instance, 0, &d);
    if (rc == NVML_SUCCESS) {
        info->device = d->parent;
        info->id = d->mig.gi_id;
        info->profileId = profile_id(d->mig.slices);
        info->placement.start = d->mig.placement_start;
        info->placement.size = d->mig.slices;
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t instance, unsigned int id,
                                                       nvmlComputeInstance_t *compute)
{
    nvmlDevice_t d;
    if (!compute)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = instance_owner_locked(instance, 0, &d);
    if (rc == NVML_SUCCESS && d->mig.ci_id != id)
        rc = NVML_ERROR_NOT_FOUND;
    if (rc == NVML_SUCCESS)
        *compute = &d->ci;
    leave();
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t instance, unsigned int profile,
                                                    nvmlComputeInstance_t *computes,
                                                    unsigned int *count)
{
    nvmlDevice_t d;
    if (!computes || !count || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = instance_owner_locked(instance, 0, &d);
    if (rc == NVML_SUCCESS) {
        *count = profile_enum(d->mig.slices) == profile;
        if (*count)
            computes[0] = &d->ci;
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t compute,
                                               nvmlComputeInstanceInfo_t *info)
{
    nvmlDevice_t d;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = instance_owner_locked(compute, 1, &d);
    if (rc == NVML_SUCCESS) {
        info->device = d->parent;
        info->gpuInstance = &d->gi;
        info->id = d->mig.ci_id;
        info->profileId = profile_enum(d->mig.slices);
        info->placement.start = 0;
        info->placement.size = d->mig.slices;
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t compute,
                                            nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(compute, info);
}

/* A MIG device's attributes (its slices and memory); a GPU's are those of the whole GPU. */
API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    int is_mig;
    struct gpu_spec g;
    struct mig_spec m;
    if (!attributes)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = device_snapshot(device, &is_mig, &g, &m, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int slices = is_mig ? m.slices : MIG_SLICES;
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = 16 * slices;
    attributes->sharedCopyEngineCount = slices;
    attributes->gpuInstanceSliceCount = slices;
    attributes->computeInstanceSliceCount = slices;
    attributes->memorySizeMB = (is_mig ? m.memory_total : g.memory_total) >> 20;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

/* A simulated MIG device is one compute instance spanning its whole GPU instance (what
 * nvmlComputeInstanceGetInfo reports): that compute instance profile, with the shared engine
 * profile, is the only one its GPU instance offers. */
static nvmlReturn_t get_ci_profile_info(nvmlGpuInstance_t instance, unsigned int profile,
                                        unsigned int engine, nvmlComputeInstanceProfileInfo_t *info)
{
    nvmlDevice_t d;
    if (!info || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ||
        engine >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return rc;
    rc = instance_owner_locked(instance, 0, &d);
    if (rc == NVML_SUCCESS && profile_enum(d->mig.slices) != profile)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS) {
        memset(info, 0, sizeof *info);
        info->id = profile;
        info->sliceCount = d->mig.slices;
        info->instanceCount = 1;
        info->multiprocessorCount = 16 * d->mig.slices;
        info->sharedCopyEngineCount = d->mig.slices;
    }
    leave();
    return rc;
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t instance,
                                                              unsigned int profile,
                                                              unsigned int engine,
                                                              nvmlComputeInstanceProfileInfo_t *info)
{
    return get_ci_profile_info(instance, profile, engine, info);
}

API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t instance,
                                                               unsigned int profile,
                                                               unsigned int engine,
                                                               nvmlComputeInstanceProfileInfo_v2_t *info)
{
    nvmlComputeInstanceProfileInfo_t v1;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlComputeInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = get_ci_profile_info(instance, profile, engine, &v1);
    if (rc != NVML_SUCCESS)
        return rc;
    info->id = v1.id;
    info->sliceCount = v1.sliceCount;
    info->instanceCount = v1.instanceCount;
    info->multiprocessorCount = v1.multiprocessorCount;
    info->sharedCopyEngineCount = v1.sharedCopyEngineCount;
    info->sharedDecoderCount = info->sharedEncoderCount = 0;
    info->sharedJpegCount = info->sharedOfaCount = 0;
    snprintf(info->name, sizeof info->name, "MIG %uc", v1.sliceCount);
    return NVML_SUCCESS;
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
