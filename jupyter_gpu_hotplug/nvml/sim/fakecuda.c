/*
 * fakecuda.c - a simulated CUDA driver library (libcuda.so.1), the few entry
 * points a "does this container have a GPU?" check calls.
 *
 * Part of jupyter-gpu-hotplug.  The simulated driver root
 * (jupyter_gpu_hotplug/nvml/sim/driver_root.py) installs it beside the fake
 * NVML as libcuda.so.<driver version>, so that NVIDIA's Container Toolkit finds
 * a driver to describe in a CDI spec, and so that a container the spec's edits
 * were applied to can ask CUDA how many GPUs it got.  Build (build.py does
 * this):
 *
 *     cc -O2 -fPIC -shared -pthread -fvisibility=hidden \
 *        -DFAKE_CUDA_DRIVER_VERSION=12040 \
 *        -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fakecuda.c
 *
 * DEVICES are decided the way the real driver's are inside a container: a GPU
 * is there when this process can open its node.  cuInit() lists the character
 * devices <dir>/nvidia<N> (<dir> is $FAKE_CUDA_DEV_DIR, default /dev), in
 * order of N, and keeps those whose open(O_RDWR) succeeds or fails with ENXIO:
 * a simulated node is a character device with no driver behind its major, so
 * ENXIO means the device cgroup let the open through.  EPERM/EACCES (the
 * cgroup or the mode refused it) and ENOENT mean "not this container's".  The
 * list is fixed at the first successful cuInit(), as the real driver's is.
 *
 * NAMES and the driver version come from the fake NVML's config file
 * ($FAKE_NVML_CONFIG, format in fakenvml.c) when it is set and readable: a
 * [gpu] section's name= for the node's minor=, and cuda_driver_version=.
 * Otherwise a GPU is named "SIMULATED GPU" and the version is the build's
 * FAKE_CUDA_DRIVER_VERSION (the Python constant DEFAULT_CUDA_DRIVER_VERSION).
 * Only those keys are read; the fake NVML validates the file.
 *
 * CHECKPOINT (issue 39): the driver's process checkpoint API, cuCheckpointProcess*,
 * with the states and argument layouts of NVIDIA's CUDA Driver API reference,
 * "CUDA Checkpointing" (docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CHECKPOINT.html)
 * and its structs CUcheckpointLockArgs, CUcheckpointRestoreArgs and
 * CUcheckpointGpuPair (structCUcheckpoint*.html).  NVIDIA's cuda-checkpoint utility,
 * which drives these calls, needs display driver 550 or later (NVIDIA technical blog,
 * "Checkpointing CUDA Applications with CRIU").  Documented there and simulated here:
 * CU_PROCESS_STATE_RUNNING=0 -Lock-> LOCKED=1 -Checkpoint-> CHECKPOINTED=2 (the GPU
 * memory is in host memory and the device handles are released) -Restore-> LOCKED
 * -Unlock-> RUNNING; a lock that times out leaves the process RUNNING; restore may remap
 * GPUs by UUID pairs, onto a GPU of the same chip type, and the pairs must name every
 * checkpointed GPU.  FAILED=3 is never entered here.
 *
 * The TARGET is a process that called the test-only fakeCudaHoldContext(ordinal,
 * bytes): it holds the node of that GPU open (O_RDWR, or O_PATH where the open reaches
 * no driver: ENXIO, as sim/load.py holds one), so the agent's busy scan sees it, and it
 * serves a control thread on the unix socket $FAKE_CUDA_CHECKPOINT_DIR/<pid>.sock.  The
 * CONTROLLER (the agent) calls cuCheckpointProcess*(pid, ...), which connect to that
 * socket (pid as the controller numbers it: a target in a pid and mount namespace of its
 * own, a sandbox's process, is reached through /proc/<pid>/root under its own number
 * there); the target runs the state machine.  Checkpoint closes the target's GPU fds
 * and keeps its "device memory" (bytes, touched) in host memory; restore reopens the
 * nodes, of the paired GPUs when gpuPairs is given: a paired UUID is looked up in the
 * fake NVML's config ([gpu] uuid=, minor=, name=), and its name must equal the old GPU's.
 *
 * Error codes where the reference names none for the case (the fake's choice, stable
 * so the agent can rely on it): no target socket (not a CUDA process) and
 * pairs for an unknown GPU: CUDA_ERROR_NOT_SUPPORTED and CUDA_ERROR_INVALID_VALUE; a
 * call in the wrong state: CUDA_ERROR_ILLEGAL_STATE; a lock timeout: CUDA_ERROR_TIMEOUT;
 * a paired GPU of another chip type: CUDA_ERROR_INVALID_VALUE; a paired node this
 * process may not open: CUDA_ERROR_INVALID_DEVICE.
 *
 * INJECTED FAILURES: the controller's $FAKE_CUDA_CHECKPOINT_FAIL, read at each call:
 * lock_timeout (Lock: CUDA_ERROR_TIMEOUT, still RUNNING), unsupported (Lock:
 * CUDA_ERROR_NOT_SUPPORTED, as for a process using UVM or IPC memory; still RUNNING),
 * checkpoint (Checkpoint: CUDA_ERROR_OUT_OF_MEMORY, still LOCKED with its GPUs held),
 * restore_other_chip (Restore: CUDA_ERROR_INVALID_VALUE, still CHECKPOINTED).
 *
 * Every other CUDA entry point is absent: a program that needs more than
 * counting devices fails at dlsym() time, which says plainly what is missing.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef FAKE_CUDA_DRIVER_VERSION
#error "build with -DFAKE_CUDA_DRIVER_VERSION=<major*1000+minor*10> (build.py does)"
#endif

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64
#define NAME_LEN 96
#define PATH_LEN 4096
#define DEFAULT_NAME "SIMULATED GPU"

typedef int CUresult;
typedef int CUdevice;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

struct error_text {
    CUresult code;
    const char *name;
    const char *text;
};

static const struct error_text errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation is not permitted in the current state"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

struct device {
    unsigned int minor;
    char name[NAME_LEN];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int device_count;
static struct device devices[MAX_DEVICES];

static int by_minor(const void *a, const void *b)
{
    const struct device *x = a, *y = b;
    return (x->minor > y->minor) - (x->minor < y->minor);
}

/* A GPU minor, 0..255, and nothing after it. */
static int parse_minor(const char *digits, unsigned int *minor)
{
    char *end;
    unsigned long value;
    if (*digits < '0' || *digits > '9')
        return -1;
    errno = 0;
    value = strtoul(digits, &end, 10);
    if (*end != '\0' || errno != 0 || value > 255)
        return -1;
    *minor = (unsigned int)value;
    return 0;
}

/* "nvidia<digits>" and nothing else (nvidiactl, nvidia-uvm are not GPUs). */
static int gpu_minor(const char *name, unsigned int *minor)
{
    if (strncmp(name, "nvidia", strlen("nvidia")) != 0)
        return -1;
    return parse_minor(name + strlen("nvidia"), minor);
}

/* Whether this process may use the node: see DEVICES above. */
static int usable(const char *path)
{
    struct stat st;
    int fd;
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode))
        return 0;
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
        close(fd);
        return 1;
    }
    return errno == ENXIO;
}

static char *trim(char *s)
{
    char *end;
    while (*s == ' ' || *s == '\t')
        s++;
    end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
        *--end = '\0';
    return s;
}

/* One [gpu] section of the fake NVML's config: the keys this library reads. */
struct config_gpu {
    unsigned int minor;
    char name[NAME_LEN];
    char uuid[NAME_LEN];
};

typedef void (*config_visit)(const struct config_gpu *gpu, void *context);

static void visit_gpu(int in_gpu, int have_minor, const struct config_gpu *gpu,
                      config_visit visit, void *context)
{
    if (in_gpu && have_minor && visit != NULL)
        visit(gpu, context);
}

/* The driver version and each [gpu] (with a minor) of the fake NVML's config, if any. */
static void read_config(int *version, config_visit visit, void *context)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    char line[512];
    struct config_gpu gpu;
    int in_gpu = 0, have_minor = 0;
    FILE *file;
    if (path == NULL || (file = fopen(path, "re")) == NULL)
        return;
    memset(&gpu, 0, sizeof gpu);
    while (fgets(line, sizeof line, file) != NULL) {
        char *text = trim(line), *eq, *key, *value;
        if (*text == '[') {
            visit_gpu(in_gpu, have_minor, &gpu, visit, context);
            in_gpu = strcmp(text, "[gpu]") == 0;
            have_minor = 0;
            memset(&gpu, 0, sizeof gpu);
            continue;
        }
        if ((eq = strchr(text, '=')) == NULL)
            continue;
        *eq = '\0';
        key = trim(text);
        value = trim(eq + 1);
        if (!in_gpu && strcmp(key, "cuda_driver_version") == 0 && version != NULL)
            *version = atoi(value);
        else if (in_gpu && strcmp(key, "minor") == 0)
            have_minor = parse_minor(value, &gpu.minor) == 0;
        else if (in_gpu && strcmp(key, "name") == 0)
            snprintf(gpu.name, sizeof gpu.name, "%s", value);
        else if (in_gpu && strcmp(key, "uuid") == 0)
            snprintf(gpu.uuid, sizeof gpu.uuid, "%s", value);
    }
    visit_gpu(in_gpu, have_minor, &gpu, visit, context);
    fclose(file);
}

static void name_device(const struct config_gpu *gpu, void *context)
{
    (void)context;
    for (int i = 0; i < device_count; i++)
        if (devices[i].minor == gpu->minor && *gpu->name)
            snprintf(devices[i].name, sizeof devices[i].name, "%s", gpu->name);
}

static int driver_version(void)
{
    int version = FAKE_CUDA_DRIVER_VERSION;
    read_config(&version, NULL, NULL);
    return version;
}

/* Where the GPU nodes are: $FAKE_CUDA_DEV_DIR, default /dev. */
static const char *dev_dir(void)
{
    const char *dir = getenv("FAKE_CUDA_DEV_DIR");
    return dir == NULL || *dir == '\0' ? "/dev" : dir;
}

static void scan_devices(void)
{
    const char *dir = dev_dir();
    char path[PATH_LEN];
    struct dirent *entry;
    DIR *listing;
    device_count = 0;
    if ((listing = opendir(dir)) == NULL)
        return;
    while ((entry = readdir(listing)) != NULL && device_count < MAX_DEVICES) {
        unsigned int minor;
        if (gpu_minor(entry->d_name, &minor) != 0)
            continue;
        if (snprintf(path, sizeof path, "%s/%s", dir, entry->d_name) >= (int)sizeof path)
            continue;
        if (!usable(path))
            continue;
        devices[device_count].minor = minor;
        snprintf(devices[device_count].name, NAME_LEN, "%s", DEFAULT_NAME);
        device_count++;
    }
    closedir(listing);
    qsort(devices, (size_t)device_count, sizeof devices[0], by_minor);
    read_config(NULL, name_device, NULL);
}

EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *version = driver_version();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuInit(unsigned int flags)
{
    CUresult result = CUDA_SUCCESS;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (!initialized) {
        scan_devices();
        initialized = device_count > 0;
    }
    if (!initialized)
        result = CUDA_ERROR_NO_DEVICE;
    pthread_mutex_unlock(&lock);
    return result;
}

static CUresult ready(void)
{
    int done;
    pthread_mutex_lock(&lock);
    done = initialized;
    pthread_mutex_unlock(&lock);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    CUresult result = ready();
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (result == CUDA_SUCCESS)
        *count = device_count;
    return result;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult result = ready();
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (result != CUDA_SUCCESS)
        return result;
    if (ordinal < 0 || ordinal >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int length, CUdevice device)
{
    CUresult result = ready();
    if (name == NULL || length <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (result != CUDA_SUCCESS)
        return result;
    if (device < 0 || device >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)length, "%s", devices[device].name);
    return CUDA_SUCCESS;
}

static const struct error_text *find_error(CUresult code)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == code)
            return &errors[i];
    return NULL;
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **text)
{
    const struct error_text *found = find_error(code);
    if (text == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *text = found ? found->text : NULL;
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **name)
{
    const struct error_text *found = find_error(code);
    if (name == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *name = found ? found->name : NULL;
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Tells the simulator's libcuda from a real driver's (as fakeNvmlConfigFormat does). */
EXPORT int fakeCudaSimulated(void)
{
    return 1;
}

/* ---- CHECKPOINT (see the header comment) ---------------------------------------------- */

typedef enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct {
    unsigned char bytes[16];
} CUuuid;

typedef struct {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

/* 64 bytes each, as in cuda.h; only the fields named are read. */
typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
    unsigned long long reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[64 - sizeof(CUcheckpointGpuPair *) - sizeof(unsigned int)];
} CUcheckpointRestoreArgs;

typedef struct {
    unsigned long long reserved[8];
} CUcheckpointUnlockArgs;

#define CHECKPOINT_DIR_ENV "FAKE_CUDA_CHECKPOINT_DIR"
#define CHECKPOINT_FAIL_ENV "FAKE_CUDA_CHECKPOINT_FAIL"

enum op { OP_STATE, OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK };
enum fail { FAIL_NONE, FAIL_LOCK_TIMEOUT, FAIL_UNSUPPORTED, FAIL_CHECKPOINT, FAIL_OTHER_CHIP };

/* One message each way on a SOCK_SEQPACKET connection: the whole call, the whole answer. */
struct request {
    int op;
    int fail;
    unsigned int pair_count;
    CUcheckpointGpuPair pairs[MAX_DEVICES];
};

struct reply {
    CUresult result;
    int state;
    int restore_tid;
    unsigned long long memory_bytes;
};

/* A GPU the target's context holds: its node's fd while RUNNING or LOCKED, else -1. */
struct held {
    unsigned int minor;
    int fd;
    CUuuid uuid;
    char name[NAME_LEN];
};

static struct {
    pthread_mutex_t lock;
    int serving;
    int listener;
    int state;
    int restore_tid;
    int count;
    struct held gpus[MAX_DEVICES];
    unsigned long long memory_bytes;
    unsigned char *host_copy;
} target = {.lock = PTHREAD_MUTEX_INITIALIZER, .listener = -1};

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's spelling) to its 16 bytes. */
static int parse_uuid(const char *text, CUuuid *uuid)
{
    static const char hex[] = "0123456789abcdef";
    int n = 0;
    if (strncmp(text, "GPU-", 4) != 0)
        return -1;
    for (const char *c = text + 4; *c; c++) {
        const char *digit = strchr(hex, *c >= 'A' && *c <= 'F' ? *c - 'A' + 'a' : *c);
        if (*c == '-')
            continue;
        if (n == 32 || digit == NULL)
            return -1;
        uuid->bytes[n / 2] = (unsigned char)(n % 2 ? uuid->bytes[n / 2] | (digit - hex)
                                                   : (digit - hex) << 4);
        n++;
    }
    return n == 32 ? 0 : -1;
}

struct config_lookup {
    unsigned int minor;
    CUuuid uuid;
    int by_uuid;
    int found;
    struct config_gpu gpu;
};

static void match_gpu(const struct config_gpu *gpu, void *context)
{
    struct config_lookup *lookup = context;
    CUuuid uuid;
    int same = lookup->by_uuid ? parse_uuid(gpu->uuid, &uuid) == 0 &&
                                     memcmp(&uuid, &lookup->uuid, sizeof uuid) == 0
                               : gpu->minor == lookup->minor;
    if (same && !lookup->found) {
        lookup->found = 1;
        lookup->gpu = *gpu;
    }
}

/* Open a GPU node as a context does; O_PATH where no driver answers (a simulated node). */
static int open_node(unsigned int minor)
{
    char path[PATH_LEN];
    int fd;
    if (snprintf(path, sizeof path, "%s/nvidia%u", dev_dir(), minor) >= (int)sizeof path)
        return -1;
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENXIO)
        fd = open(path, O_PATH | O_CLOEXEC);
    return fd;
}

static void close_nodes(struct held *gpus, int count)
{
    for (int i = 0; i < count; i++)
        if (gpus[i].fd >= 0) {
            close(gpus[i].fd);
            gpus[i].fd = -1;
        }
}

static CUresult do_checkpoint(int fail)
{
    unsigned char *copy;
    if (fail == FAIL_CHECKPOINT)
        return CUDA_ERROR_OUT_OF_MEMORY;
    copy = malloc(target.memory_bytes ? target.memory_bytes : 1);
    if (copy == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memset(copy, 0xC5, target.memory_bytes); /* host pages really in use, as the real copy's */
    target.host_copy = copy;
    close_nodes(target.gpus, target.count);
    target.state = CU_PROCESS_STATE_CHECKPOINTED;
    return CUDA_SUCCESS;
}

/* Where GPU `gpu` goes on restore: itself, or its pair's new GPU (same name), by minor. */
static CUresult destination(const struct held *gpu, const struct request *request,
                            struct held *to)
{
    struct config_lookup lookup = {.by_uuid = 1};
    unsigned int i;
    *to = *gpu;
    if (request->pair_count == 0)
        return CUDA_SUCCESS;
    for (i = 0; i < request->pair_count; i++)
        if (memcmp(&request->pairs[i].oldUuid, &gpu->uuid, sizeof gpu->uuid) == 0)
            break;
    if (i == request->pair_count)
        return CUDA_ERROR_INVALID_VALUE; /* the pairs must name every checkpointed GPU */
    lookup.uuid = request->pairs[i].newUuid;
    read_config(NULL, match_gpu, &lookup);
    if (!lookup.found || strcmp(lookup.gpu.name, gpu->name) != 0)
        return CUDA_ERROR_INVALID_VALUE; /* unknown, or another chip type */
    to->minor = lookup.gpu.minor;
    to->uuid = lookup.uuid;
    return CUDA_SUCCESS;
}

static CUresult do_restore(const struct request *request)
{
    struct held moved[MAX_DEVICES];
    CUresult result = CUDA_SUCCESS;
    int opened = 0;
    if (request->fail == FAIL_OTHER_CHIP || request->pair_count > MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    for (; opened < target.count && result == CUDA_SUCCESS; opened++) {
        result = destination(&target.gpus[opened], request, &moved[opened]);
        if (result == CUDA_SUCCESS && (moved[opened].fd = open_node(moved[opened].minor)) < 0)
            result = CUDA_ERROR_INVALID_DEVICE;
    }
    if (result != CUDA_SUCCESS) {
        close_nodes(moved, opened); /* the one that failed holds no fd */
        return result;
    }
    memcpy(target.gpus, moved, sizeof moved[0] * (size_t)target.count);
    free(target.host_copy);
    target.host_copy = NULL;
    target.state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static const int required_state[] = {
    [OP_STATE] = -1,
    [OP_LOCK] = CU_PROCESS_STATE_RUNNING,
    [OP_CHECKPOINT] = CU_PROCESS_STATE_LOCKED,
    [OP_RESTORE] = CU_PROCESS_STATE_CHECKPOINTED,
    [OP_UNLOCK] = CU_PROCESS_STATE_LOCKED,
};

/* The state machine, run by the target on one request. */
static CUresult serve(const struct request *request)
{
    if (request->op < OP_STATE || request->op > OP_UNLOCK)
        return CUDA_ERROR_INVALID_VALUE;
    if (request->op != OP_STATE && target.state != required_state[request->op])
        return CUDA_ERROR_ILLEGAL_STATE;
    switch (request->op) {
    case OP_LOCK:
        if (request->fail == FAIL_LOCK_TIMEOUT)
            return CUDA_ERROR_TIMEOUT;
        if (request->fail == FAIL_UNSUPPORTED)
            return CUDA_ERROR_NOT_SUPPORTED;
        target.state = CU_PROCESS_STATE_LOCKED;
        return CUDA_SUCCESS;
    case OP_CHECKPOINT:
        return do_checkpoint(request->fail);
    case OP_RESTORE:
        return do_restore(request);
    case OP_UNLOCK:
        target.state = CU_PROCESS_STATE_RUNNING;
        return CUDA_SUCCESS;
    default:
        return CUDA_SUCCESS;
    }
}

static void *control_thread(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&target.lock);
    target.restore_tid = (int)syscall(SYS_gettid);
    pthread_mutex_unlock(&target.lock);
    for (;;) {
        struct request request;
        struct reply reply;
        int connection = accept4(target.listener, NULL, NULL, SOCK_CLOEXEC);
        if (connection < 0)
            continue;
        memset(&reply, 0, sizeof reply);
        if (recv(connection, &request, sizeof request, 0) != (ssize_t)sizeof request) {
            reply.result = CUDA_ERROR_INVALID_VALUE;
        } else {
            pthread_mutex_lock(&target.lock);
            reply.result = serve(&request);
            reply.state = target.state;
            reply.restore_tid = target.restore_tid;
            reply.memory_bytes = target.memory_bytes;
            pthread_mutex_unlock(&target.lock);
        }
        send(connection, &reply, sizeof reply, MSG_NOSIGNAL);
        close(connection);
    }
    return NULL;
}

/*
 * The target's socket: `root` + $FAKE_CUDA_CHECKPOINT_DIR/<pid>.sock, <pid> as the target
 * numbers itself.  The target passes its own getpid() and root "".
 */
static int socket_path(const char *root, int pid, struct sockaddr_un *address)
{
    const char *dir = getenv(CHECKPOINT_DIR_ENV);
    memset(address, 0, sizeof *address);
    address->sun_family = AF_UNIX;
    if (dir == NULL || *dir == '\0')
        return -1;
    return snprintf(address->sun_path, sizeof address->sun_path, "%s%s/%d.sock", root, dir,
                    pid) < (int)sizeof address->sun_path
               ? 0
               : -1;
}

/*
 * The controller's way to the socket of host process `pid`, as the real driver takes
 * host pids: a target in a pid namespace of its own (a sandbox, a container) named its
 * socket by its own number there, the last of /proc/<pid>/status's NSpid, in its own
 * mount namespace, reached through /proc/<pid>/root.  Elsewhere: the plain path.
 */
static int target_socket_path(int pid, struct sockaddr_un *address)
{
    char path[64], line[256], root[64];
    int inner = pid, nested = 0;
    FILE *status;
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    status = fopen(path, "re");
    while (status != NULL && fgets(line, sizeof line, status) != NULL) {
        char *field, *rest;
        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        for (field = strtok_r(line + 6, " \t\n", &rest); field != NULL;
             field = strtok_r(NULL, " \t\n", &rest), nested++)
            inner = atoi(field);
        break;
    }
    if (status != NULL)
        fclose(status);
    if (nested <= 1)
        return socket_path("", pid, address);
    snprintf(root, sizeof root, "/proc/%d/root", pid);
    return socket_path(root, inner, address);
}

/* Listen on this process's socket (once); the thread answers the controller's calls. */
static CUresult start_serving(void)
{
    struct sockaddr_un address;
    pthread_t thread;
    int fd;
    if (target.serving)
        return CUDA_SUCCESS;
    if (socket_path("", getpid(), &address) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_UNKNOWN;
    unlink(address.sun_path);
    if (bind(fd, (struct sockaddr *)&address, sizeof address) != 0 || listen(fd, 8) != 0) {
        close(fd);
        return CUDA_ERROR_UNKNOWN;
    }
    target.listener = fd;
    if (pthread_create(&thread, NULL, control_thread, NULL) != 0) {
        close(fd);
        target.listener = -1;
        return CUDA_ERROR_UNKNOWN;
    }
    pthread_detach(thread);
    target.serving = 1;
    return CUDA_SUCCESS;
}

/*
 * TEST-ONLY: make this process a CUDA process using GPU `ordinal` (after cuInit) with
 * `memory_bytes` of device memory: hold its node open and answer checkpoint calls on
 * $FAKE_CUDA_CHECKPOINT_DIR/<pid>.sock.  Call once per GPU; the bytes are the total.
 */
EXPORT CUresult fakeCudaHoldContext(int ordinal, unsigned long long memory_bytes)
{
    struct config_lookup lookup = {0};
    struct held *gpu;
    CUresult result = ready();
    if (result != CUDA_SUCCESS)
        return result;
    if (ordinal < 0 || ordinal >= device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&target.lock);
    if (target.state != CU_PROCESS_STATE_RUNNING || target.count == MAX_DEVICES) {
        pthread_mutex_unlock(&target.lock);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    gpu = &target.gpus[target.count];
    memset(gpu, 0, sizeof *gpu);
    gpu->minor = devices[ordinal].minor;
    snprintf(gpu->name, sizeof gpu->name, "%s", devices[ordinal].name);
    lookup.minor = gpu->minor;
    read_config(NULL, match_gpu, &lookup);
    if (lookup.found)
        parse_uuid(lookup.gpu.uuid, &gpu->uuid);
    if ((gpu->fd = open_node(gpu->minor)) < 0)
        result = CUDA_ERROR_INVALID_DEVICE;
    else if ((result = start_serving()) != CUDA_SUCCESS)
        close_nodes(gpu, 1);
    if (result == CUDA_SUCCESS) {
        target.count++;
        target.memory_bytes = memory_bytes;
    }
    pthread_mutex_unlock(&target.lock);
    return result;
}

static int injected_failure(void)
{
    static const char *const names[] = {
        [FAIL_LOCK_TIMEOUT] = "lock_timeout",
        [FAIL_UNSUPPORTED] = "unsupported",
        [FAIL_CHECKPOINT] = "checkpoint",
        [FAIL_OTHER_CHIP] = "restore_other_chip",
    };
    const char *value = getenv(CHECKPOINT_FAIL_ENV);
    for (int i = FAIL_LOCK_TIMEOUT; value != NULL && i <= FAIL_OTHER_CHIP; i++)
        if (strcmp(value, names[i]) == 0)
            return i;
    return FAIL_NONE;
}

/* The controller's side: one request to the target `pid`, its answer in `reply`. */
static CUresult call(int pid, struct request *request, struct reply *reply)
{
    struct sockaddr_un address;
    int fd;
    ssize_t got;
    request->fail = injected_failure();
    if (pid <= 0 || target_socket_path(pid, &address) != 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_UNKNOWN;
    if (connect(fd, (struct sockaddr *)&address, sizeof address) != 0) {
        close(fd);
        return CUDA_ERROR_NOT_SUPPORTED; /* no CUDA context in that process */
    }
    if (send(fd, request, sizeof *request, MSG_NOSIGNAL) != (ssize_t)sizeof *request) {
        close(fd);
        return CUDA_ERROR_UNKNOWN;
    }
    got = recv(fd, reply, sizeof *reply, 0);
    close(fd);
    return got == (ssize_t)sizeof *reply ? reply->result : CUDA_ERROR_UNKNOWN;
}

static CUresult simple_call(int pid, enum op op, struct reply *reply)
{
    struct request request;
    memset(&request, 0, sizeof request);
    request.op = op;
    return call(pid, &request, reply);
}

/* A question about the target (no state change): its answer, if `out` can take one. */
static CUresult query(int pid, const void *out, struct reply *reply)
{
    return out == NULL ? CUDA_ERROR_INVALID_VALUE : simple_call(pid, OP_STATE, reply);
}

EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    struct reply reply;
    CUresult result = query(pid, state, &reply);
    if (result == CUDA_SUCCESS)
        *state = (CUprocessState)reply.state;
    return result;
}

EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    struct reply reply;
    CUresult result = query(pid, tid, &reply);
    if (result == CUDA_SUCCESS)
        *tid = reply.restore_tid;
    return result;
}

/* The lock never waits here (the target has no work in flight), so a timeout is injected. */
EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    struct reply reply;
    (void)args;
    return simple_call(pid, OP_LOCK, &reply);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    struct reply reply;
    (void)args;
    return simple_call(pid, OP_CHECKPOINT, &reply);
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    struct request request;
    struct reply reply;
    memset(&request, 0, sizeof request);
    request.op = OP_RESTORE;
    if (args != NULL && args->gpuPairsCount > 0) {
        if (args->gpuPairs == NULL || args->gpuPairsCount > MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
        request.pair_count = args->gpuPairsCount;
        memcpy(request.pairs, args->gpuPairs, sizeof args->gpuPairs[0] * args->gpuPairsCount);
    }
    return call(pid, &request, &reply);
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    struct reply reply;
    (void)args;
    return simple_call(pid, OP_UNLOCK, &reply);
}

/* TEST-ONLY: the device memory (bytes) the target `pid` uses, what a checkpoint keeps in
 * host memory; on a real GPU NVML's per-process usedGpuMemory says it. */
EXPORT CUresult fakeCudaProcessMemory(int pid, unsigned long long *bytes)
{
    struct reply reply;
    CUresult result = query(pid, bytes, &reply);
    if (result == CUDA_SUCCESS)
        *bytes = reply.memory_bytes;
    return result;
}
