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
#include <sys/stat.h>
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
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
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
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
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

static void name_device(unsigned int minor, const char *name)
{
    for (int i = 0; i < device_count; i++)
        if (devices[i].minor == minor)
            snprintf(devices[i].name, sizeof devices[i].name, "%s", name);
}

/* The names (by minor) and driver version in the fake NVML's config, if any. */
static void read_config(int *version)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    char line[512], name[NAME_LEN] = "";
    int in_gpu = 0, have_minor = 0;
    unsigned int minor = 0;
    FILE *file;
    if (path == NULL || (file = fopen(path, "re")) == NULL)
        return;
    while (fgets(line, sizeof line, file) != NULL) {
        char *text = trim(line), *eq, *key, *value;
        if (*text == '[') {
            if (in_gpu && have_minor && *name)
                name_device(minor, name);
            in_gpu = strcmp(text, "[gpu]") == 0;
            have_minor = 0;
            name[0] = '\0';
            continue;
        }
        if ((eq = strchr(text, '=')) == NULL)
            continue;
        *eq = '\0';
        key = trim(text);
        value = trim(eq + 1);
        if (!in_gpu && strcmp(key, "cuda_driver_version") == 0)
            *version = atoi(value);
        else if (in_gpu && strcmp(key, "minor") == 0)
            have_minor = parse_minor(value, &minor) == 0;
        else if (in_gpu && strcmp(key, "name") == 0)
            snprintf(name, sizeof name, "%s", value);
    }
    if (in_gpu && have_minor && *name)
        name_device(minor, name);
    fclose(file);
}

static int driver_version(void)
{
    int version = FAKE_CUDA_DRIVER_VERSION;
    read_config(&version);
    return version;
}

static void scan_devices(void)
{
    const char *dir = getenv("FAKE_CUDA_DEV_DIR");
    char path[PATH_LEN];
    struct dirent *entry;
    DIR *listing;
    int ignored = 0;
    if (dir == NULL || *dir == '\0')
        dir = "/dev";
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
    read_config(&ignored);
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
