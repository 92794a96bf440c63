// DSA-TRT TensorRT plugins: what the seven IPluginV3 adapters share.
//
// A plugin is an adapter (STYLE.md): fields, shape inference, format check, workspace size,
// enqueue -> dsa_launch_*, serialisation of its few scalars. No logic lives here. The contract
// (inputs, outputs, dtypes, fields, aliasing) is plugins/tensorrt/PLUGINS.md.
//
//   PluginBase<Derived, Build>   IPluginV3 + OneCore + Build (OneBuild or OneBuildV2) + OneRuntime.
//                                Implements every TensorRT entry point as noexcept and catches;
//                                Derived supplies the op-specific parts as plain member functions
//                                that may throw PluginError (see "What Derived provides" below).
//   PoolWritePlugin<Derived>     PluginBase over OneBuildV2 for the in-place cache writes: output 0
//                                is input Derived::kPool (aliased buffer, same dtype and shape).
//   PluginCreator<Plugin>        IPluginCreatorV3One of one plugin: field names, createPlugin.
//   FieldValues                  the scalar fields of a PluginFieldCollection, ONNX ints arriving as
//                                kINT32 or kINT64, floats as kFLOAT32 or kFLOAT64; length checked.
//   SerialFields                 the few scalars a plugin serialises (kINT32 / kFLOAT32).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsa_kernels.h"

namespace dsa_trt
{

namespace nv = nvinfer1;

inline constexpr char kPluginNamespace[] = "dsa";
inline constexpr char kPluginVersion[] = "1";

// ---------------------------------------------------------------- errors and logging
// Thrown by the adapters with a message that names the bad value; never crosses into TensorRT.
class PluginError : public std::runtime_error
{
public:
    using std::runtime_error::runtime_error;
};

std::string strprintf(char const* fmt, ...) __attribute__((format(printf, 1, 2)));

#define DSA_TRT_REQUIRE(cond, ...)                                                                                     \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
            throw ::dsa_trt::PluginError(::dsa_trt::strprintf(__VA_ARGS__));                                          \
    } while (0)

// The logger TensorRT handed over through setLoggerFinder(), else libnvinfer's getLogger(), else stderr.
void setLoggerFinder(nv::ILoggerFinder* finder) noexcept;
void logMessage(nv::ILogger::Severity severity, std::string const& msg) noexcept;
// "[dsa::DsaSparseMla] enqueue: <what>" at kERROR.
void logError(char const* plugin, char const* method, char const* what) noexcept;

// ---------------------------------------------------------------- fields
enum class FieldKind
{
    kInt,   // ONNX INT attribute: kINT32 or kINT64 (kINT8 / kINT16 accepted too)
    kFloat, // ONNX FLOAT attribute: kFLOAT32 or kFLOAT64 (an integer field type is accepted too)
};

struct FieldSpec
{
    char const* name;
    FieldKind kind;
};

// Every field of `specs` must be present exactly once with length 1. Fields TensorRT's ONNX parser
// may pass through (plugin_version, plugin_namespace) are ignored; any other unknown field is an
// error, so a misspelt attribute in export/ fails the build instead of being silently dropped.
class FieldValues
{
public:
    FieldValues(char const* plugin, nv::PluginFieldCollection const* fc, FieldSpec const* specs, int32_t nbSpecs);

    int32_t intInRange(char const* name, int64_t lo, int64_t hi) const;
    float positiveFloat(char const* name) const; // finite and > 0
    int32_t cacheFormat() const;                 // field "cache_format": DSA_CACHE_FP8 or DSA_CACHE_BF16

private:
    struct Value
    {
        char const* name;
        FieldKind kind;
        int64_t i;
        double f;
    };
    Value const& find(char const* name) const;

    char const* mPlugin;
    std::vector<Value> mValues;
};

// The serialised fields of one plugin; rebuilt on every getFieldsToSerialize() call because a
// clone copies this object and the pointers must name the clone's members.
class SerialFields
{
public:
    void clear() noexcept;
    void addInt(char const* name, int32_t const* value);
    void addFloat(char const* name, float const* value);
    nv::PluginFieldCollection const* collection() noexcept;

private:
    std::vector<nv::PluginField> mFields;
    nv::PluginFieldCollection mCollection{};
};

// ---------------------------------------------------------------- dtypes and shapes
char const* dataTypeName(nv::DataType t) noexcept;
std::string dimsString(nv::Dims const& d);

// Raw-byte carriers an fp8-mode pool may be declared with (PLUGINS.md "Byte pools"): kINT32 (4 bytes
// per element, innermost dim divided by 4; recommended), kINT8 or kUINT8 (1 byte per element).
// 0 for any other type.
int64_t byteCarrierSize(nv::DataType t) noexcept;
// The pool dtype rule of every plugin: fp8 -> a byte carrier, bf16 -> kBF16.
bool isPoolType(int32_t cacheFormat, nv::DataType t) noexcept;
// Innermost extent in elements of a pool row of `bytes` bytes (fp8) or `bf16Elems` bf16 values.
int64_t poolInnerExtent(int32_t cacheFormat, nv::DataType t, int64_t bytes, int64_t bf16Elems) noexcept;

// Shape checks that skip wildcard (-1) extents, so the same check serves configurePlugin (build,
// dims may hold -1) and onShapeChange (runtime, concrete). Messages name tensor, dim and value.
void expectRank(nv::Dims const& d, int32_t rank, char const* tensor);
void expectDim(nv::Dims const& d, int32_t i, int64_t value, char const* tensor);
void expectSameDim(nv::Dims const& a, int32_t ai, char const* ta, nv::Dims const& b, int32_t bi, char const* tb);
// Products that the kernels index with int32 (slot ids, page table entries) must fit int32.
void expectInt32(int64_t value, char const* what);

// 128-wide blocks of an fp8 weight extent (the scale tensors' extents): ceil(n / 128).
inline int64_t fp8Blocks(int64_t n)
{
    return (n + DSA_FP8_BLOCK - 1) / DSA_FP8_BLOCK;
}

// The two pools (docs/architecture.md §5), checked against their cache format and declared dtype:
//   MLA pool      fp8 [P, 64, 576 bytes]      bf16 [P, 64, 576]
//   indexer pool  fp8 [P, 64 * 132 bytes]     bf16 [P, 64, 128]
// "bytes" = extent in elements of the byte carrier. Both return P (-1 while unknown at build).
int64_t checkMlaPool(nv::PluginTensorDesc const& pool, int32_t cacheFormat, char const* tensor);
int64_t checkIndexerPool(nv::PluginTensorDesc const& pool, int32_t cacheFormat, char const* tensor);

// The cache writes update their pool in place: TensorRT must hand the aliased output the input's
// buffer (IPluginV3OneBuildV2::getAliasedInput, PreviewFeature::kALIASED_PLUGIN_IO_10_03).
void expectAliased(void const* input, void const* output, int32_t inputIndex);

} // namespace dsa_trt

#include "plugin_base.h"
