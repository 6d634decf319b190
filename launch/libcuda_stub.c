/* A libcuda.so.1 with no device: lets the CUDA build of sgl_kernel import on a
 * machine without a GPU. Every entry point reports CUDA_ERROR_NO_DEVICE (100).
 * torch still reports cuda.is_available() == False with it loaded. */
int cuPointerGetAttribute(void *d, int a, unsigned long long p) { (void)d; (void)a; (void)p; return 100; }
int cuInit(unsigned int f) { (void)f; return 100; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return 100; }
int cuDeviceGetCount(int *c) { if (c) *c = 0; return 100; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f, void *st) { (void)s; (void)v; (void)f; (void)st; if (p) *p = 0; return 100; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { (void)s; (void)v; (void)f; (void)st; if (p) *p = 0; return 100; }
